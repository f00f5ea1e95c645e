"""One session as the router's session table holds it (a record of cache/records.py, key:
the session id in hex): what another router needs to take the session over or to stream
it to a client that reconnects there.

    {"v": 1, "id": hex, "contract": hex of its CBOR, "prompt": [ids], "created": unix s,
     "epoch": E,             the SDCP epoch the placement runs at
     "allocated": A,         the highest epoch this session's owners allocated for a fence
                             (A > E: a fence or failover under way)
     "verifier", "drafter",  the placement (null: none yet)
     "resume_pending",       fenced at E, open nowhere yet
     "sampling", "policy_from_round",   a policy update's profile, if any
     "relayed": n,           output tokens relayed to clients when the record was last written
                             for another reason (a placement, an end): a hint; the commit log
                             holds every committed token, and a resuming client names its own
     "door": {...},          the client-facing stream: which API and its options
     "finish", "cancelled", "final_tokens", "finished": the end, once known
     "history": [...]}       the last placements (clients and tests read them)

JSON, with the contract as the hex of its deterministic CBOR (the contract digest is over
those bytes). Written before the router acts (router/ownership.py).
"""

from __future__ import annotations

import json
import time

from ..core.messages import Action, Sampling
from ..refs import commit_log_name, contract_from_text, contract_text
from .sessions import HISTORY_KEPT, RouterSession

VERSION = 1


def key_of(session: bytes) -> str:
    return session.hex()


def encode(s: RouterSession) -> bytes:
    return json.dumps({
        "v": VERSION, "id": s.id.hex(), "contract": contract_text(s.contract), "prompt": list(s.prompt),
        "created": s.created_wall, "epoch": s.epoch, "allocated": max(s.allocated, s.epoch),
        "verifier": s.verifier, "drafter": s.drafter, "resume_pending": s.resume_pending,
        "sampling": None if s.sampling is None else s.sampling.to_obj(),
        "policy_from_round": s.policy_from_round, "relayed": len(s.tokens), "door": s.door,
        "finish": None if s.finish is None else s.finish.name.lower(), "cancelled": s.cancelled,
        "final_tokens": s.final_tokens, "finished": s.finished_wall,
        "history": s.history[-HISTORY_KEPT:],
    }, separators=(",", ":")).encode()


def decode(data: bytes) -> dict:
    obj = json.loads(data)
    if obj.get("v") != VERSION:
        raise ValueError(f"session record of version {obj.get('v')!r}, not {VERSION}")
    return obj


def restore(obj: dict, into: RouterSession | None = None) -> RouterSession:
    """A RouterSession from a record (or `into`, a session streamed here already, brought up
    to date: its tokens are never shortened, streams hold indices into them)."""
    sid = bytes.fromhex(obj["id"])
    s = into or RouterSession(sid, contract_from_text(obj["contract"]),
                              tuple(obj["prompt"]), commit_log_name(sid))
    s.epoch = obj["epoch"]
    s.allocated = obj["allocated"]
    s.verifier, s.drafter = obj["verifier"], obj["drafter"]
    s.resume_pending = obj["resume_pending"]
    s.sampling = None if obj["sampling"] is None else Sampling.from_obj(obj["sampling"])
    s.policy_from_round = obj["policy_from_round"]
    s.door = obj["door"]
    s.history = list(obj["history"])
    if into is None:
        s.created_wall = obj["created"]
        s.created = time.monotonic() - max(0.0, time.time() - obj["created"])
    end(obj, s)
    return s


def end(obj: dict, s: RouterSession) -> bool:
    """Take the record's end into `s`, if it has one; True if it has."""
    if obj["finish"] is None and obj["cancelled"] is None:
        return False
    if not s.done:
        s.finish = None if obj["finish"] is None else Action[obj["finish"].upper()]
        s.cancelled = obj["cancelled"]
        s.final_tokens = obj["final_tokens"]
        s.finished_wall = obj["finished"]
        s.finished_at = time.monotonic() - max(0.0, time.time() - (obj["finished"] or time.time()))
    return True
