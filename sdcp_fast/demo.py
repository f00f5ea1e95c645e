"""`sdcp-fast demo`: the README's main job.

Until the multi-process demo lands, this runs the smallest real job the code can do: it
validates the example contract, computes its digest and d[0], and walks one session through
the verifier's state machine with a perfect greedy drafter.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .cli import _load_contract
from .core.messages import Assignment, Proposal, SessionOpen, Status
from .core.session import Job, VerifierSession

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "contract.json"


def main(args: argparse.Namespace) -> int:
    contract = _load_contract(EXAMPLE)
    print(f"contract digest {contract.digest.hex()}")
    sid, drafter = bytes(16), "https://drafter.local/"
    session = VerifierSession.open(SessionOpen(sid, 1, contract, (1, 2, 3), "file:log"),
                                   model_digest=contract.target, prompt=(1, 2, 3))
    session.assign(Assignment(sid, 1, contract, "https://verifier.local/", drafter, (1, 2, 3),
                              0, 0, session.digest, 4))
    while not session.closed:
        m = min(session.m_cap, contract.m_max)
        tokens = tuple(range(session.committed + 10, session.committed + 10 + m))
        job = session.check(drafter, Proposal(sid, 1, session.round + 1, drafter, session.committed,
                                              session.digest, tokens, Status(drafter, 1, 0, 0, 1000)))
        assert isinstance(job, Job)
        session.complete(job, job.m, 7, load=0)
        verdict = session.commit_result(True)
        print(f"round {verdict.round}: accepted {verdict.accepted}/{job.m} emitted {list(verdict.emitted)} "
              f"action {verdict.action.name.lower()} m_cap {verdict.m_cap}")
    print(f"committed {session.committed} tokens, d[n] {session.digest.hex()}")
    return 0
