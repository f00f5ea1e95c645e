"""The demo's client: streams every prompt from the router's front door at once (server-sent
events over plain HTTP), with one live line per prompt on a terminal. A stream that breaks
(its router died) is resumed at the next router with its id and `from=n`."""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx


@dataclass
class Generation:
    prompt: str                       # the text shown (the user's turn for a chat prompt)
    prompt_tokens: list[int] | None = None   # sent as token ids when given (chat template applied)
    stop: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    gid: str = ""
    finish: str | None = None
    seconds: float = 0.0
    error: str | None = None
    resumed: list[int] = field(default_factory=list)    # token counts at which it was resumed


def generate_all(fronts: str | list[str], generations: list[Generation], max_new: int) -> float:
    """Stream every prompt at once from the first front door (the others: where a broken
    stream resumes); show one live line per prompt. Returns wall seconds."""
    fronts = [fronts] if isinstance(fronts, str) else list(fronts)
    live = sys.stdout.isatty()
    lock = threading.Lock()
    started = time.perf_counter()
    done = threading.Event()

    def show() -> None:
        width = shutil.get_terminal_size((100, 20)).columns - 16
        with lock:
            for n, g in enumerate(generations):
                tail = (g.text.replace("\n", "\u21b5")[-width:]) if g.text else ""
                print(f"\x1b[2K[{n + 1}] {len(g.tokens):3d}/{max_new} {tail}")
            print(f"\x1b[{len(generations)}A", end="", flush=True)

    def progress() -> None:
        while not done.wait(0.1 if live else 1.0):
            if live:
                show()
            else:
                with lock:
                    counts = " ".join(f"[{n + 1}] {len(g.tokens)}" for n, g in enumerate(generations))
                print(f"  {time.perf_counter() - started:5.1f} s  tokens {counts}", flush=True)

    ticker = threading.Thread(target=progress, daemon=True)
    ticker.start()
    pool = ThreadPoolExecutor(len(generations))
    try:
        list(pool.map(lambda g: stream_one(fronts, g, max_new, lock), generations))
    finally:
        # on Ctrl-C do not wait for the streams: stopping the processes ends them
        pool.shutdown(wait=False, cancel_futures=True)
        done.set()
    wall = time.perf_counter() - started
    ticker.join()
    if live:
        show()
        print("\n" * len(generations), end="")
    return wall


def stream_one(fronts: list[str], g: Generation, max_new: int, lock: threading.Lock) -> None:
    """The generation's stream from the first front door; while it breaks before its end,
    the rest of it from the next ones (GET .../stream?from=n: no token lost or repeated)."""
    for n, front in enumerate(fronts):
        if n and not g.gid:
            return                    # broke before the id came: nothing to resume
        if n:
            g.resumed.append(len(g.tokens))
            request = ("GET", f"{front}/v1/generations/{g.gid}/stream?from={len(g.tokens)}", None)
        else:
            request = ("POST", f"{front}/v1/generate", request_body(g, max_new))
        if _stream(request, g, lock) or g.error:
            return
    g.error = g.error or "the stream broke and no router was left to resume it"


def _stream(request, g: Generation, lock: threading.Lock) -> bool:
    """Read one stream into `g`; True once its end came, False if it broke first."""
    method, url, body = request
    try:
        with httpx.Client(timeout=httpx.Timeout(300.0, connect=10.0)) as http, \
                http.stream(method, url, json=body) as r:
            if r.status_code != 200:
                g.error = f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:200]}"
                return False
            name = None
            for line in r.iter_lines():
                if line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("data:"):
                    data = json.loads(line[5:])
                    with lock:
                        if name == "start":
                            g.gid = data["id"]
                        elif name == "tokens":
                            g.tokens.extend(data["tokens"])
                            g.text += data["text"]
                        elif name == "end":
                            g.finish, g.text = data["finish"], data["text"]
                            g.seconds = data.get("seconds") or 0.0
                            return True
    except (httpx.TransportError, httpx.StreamError):
        return False                  # the router went away mid-stream
    except Exception as exc:   # the table reports it; the demo still cleans up
        g.error = f"{type(exc).__name__}: {exc}"
    return False


def request_body(g: Generation, max_new: int) -> dict:
    body = {"tokens": g.prompt_tokens} if g.prompt_tokens is not None else {"prompt": g.prompt}
    return body | {"max_new": max_new} | ({"stop": g.stop} if g.stop else {})


def wait_live(front: str, count: int, timeout: float) -> None:
    """Until `count` instances are live in the router's registry."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            instances = httpx.get(f"{front}/v1/instances", timeout=5).json()["instances"]
            if sum(1 for i in instances if i["live"]) >= count:
                return
        if time.monotonic() > deadline:
            raise TimeoutError("instances did not report status in time")
        time.sleep(0.1)
