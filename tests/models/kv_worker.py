"""Run in a subprocess by test_kv_transfer.py: one side of a cross-process KV hand-off.

kv_worker.py export SPEC OUTDIR   open + score + partial commit, write blob.bin, then
                                  continue the original session and, separately, an
                                  imported copy of the blob (original.pt, reimported.pt)
kv_worker.py import SPEC OUTDIR   import blob.bin into a fresh backend, continue
                                  (imported.pt)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from sdcp_fast.models import load_backend

PROMPT = [30, 31, 32, 33, 34, 35]
PROPOSAL = [40, 41, 42, 43]
EMITTED = [40, 41, 99]  # two accepted, one replaced


def continue_session(backend, session: bytes) -> dict:
    """Two more rounds, greedy: the rows scored and the tokens chosen."""
    rows, chosen = [], []
    proposal = [7, 8, 9]
    for _ in range(2):
        out = backend.score([(session, proposal)])
        rows.append(out)
        token = int(out[0].argmax())
        chosen.append(token)
        backend.commit(session, [token])
        proposal = [token, 1, 2]
    return {"rows": torch.cat(rows), "chosen": chosen, "committed": backend.committed(session)}


def main() -> None:
    mode, spec, outdir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    torch.set_num_threads(1)  # same summation order in every process
    backend = load_backend(spec)
    if mode == "export":
        backend.open(b"s", PROMPT)
        backend.score([(b"s", PROPOSAL)])
        backend.commit(b"s", EMITTED)
        blob = backend.export_kv(b"s")
        (outdir / "blob.bin").write_bytes(blob)
        torch.save(continue_session(backend, b"s"), outdir / "original.pt")
        backend.import_kv(b"copy", blob)
        torch.save(continue_session(backend, b"copy"), outdir / "reimported.pt")
    elif mode == "import":
        backend.import_kv(b"other-name", (outdir / "blob.bin").read_bytes())
        torch.save(continue_session(backend, b"other-name"), outdir / "imported.pt")
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
