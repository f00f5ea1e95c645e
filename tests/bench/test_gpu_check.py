"""The rehearsal of bench/gpu_check.sh (GPU_CHECK_SMOKE=1) on this machine, wheels included:
bench/gpu_wheels.sh downloads the few wheels the GPU machine lacks (needs PyPI; pip's cache
makes reruns quick), the check installs them for Python 3.12, runs a sample of its tests,
the compile check for sm_90 (a quick sweep), the kernel benchmark (with the compiler's
figures beside each point) and the verifier end to end at tiny sizes through the Triton
interpreter, and audits that every module any step imported exists on the GPU machine or
in a wheel. Marked slow: about 90 s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_rehearsal_passes(tmp_path):
    wheels, out = tmp_path / "whl", tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable}
    got = subprocess.run(["bash", str(REPO / "bench" / "gpu_wheels.sh"), str(wheels)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stdout + got.stderr
    env.update(GPU_CHECK_SMOKE="1", GPU_WHEELS=str(wheels))
    env.pop("SDCP_KERNELS_PATH", None)
    got = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), str(out)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stdout[-6000:] + got.stderr[-3000:]

    summary = json.loads((out / "summary.json").read_text())
    assert summary["smoke"] is True and summary["seconds"] <= 480   # its limit there (270 s on a GPU)
    assert all(summary[k] == 0 for k in ("wheels_rc", "tests_rc", "gpu_compile_rc", "gpu_bench_rc", "gpu_e2e_rc",
                                         "imports_rc"))
    assert "imports ok" in (out / "imports.log").read_text()
    assert 'failures="0"' in (out / "tests.xml").read_text()
    bench = json.loads((out / "gpu_bench.json").read_text())
    assert bench["points"] and not bench["skipped_for_time"]
    bench_log = (out / "gpu_bench.log").read_text()
    assert bench_log.strip().splitlines()[-1].startswith("gpu_bench: 3 points, 0 skipped; ")
    # the compile check for the H100/H200 target (no device here), its figures beside each point
    compiled = "gpu compile: 6 kernels x 18 specialisations x 1 targets, 0 failures, "
    assert compiled in bench_log and bench["gpu_compile"].startswith(compiled)
    for point in bench["points"]:
        kernels = point["kernels"]
        assert {"_chunk_stats_kernel", "_row_finalize_kernel", "_accept_kernel"} <= set(kernels)
        assert all(k["registers"] > 0 and k["spills"] == 0 and k["blocks_per_sm"] >= 2 and k["us"] is None
                   for k in kernels.values())
    # the device tool brings back 8 files at most: these, and the rehearsal's audit
    assert {f.name for f in out.iterdir()} == {
        "environment.txt", "tests.log", "tests.xml", "gpu_bench.log", "gpu_bench.json", "gpu_e2e.log",
        "gpu_e2e.json", "summary.json", "imports.txt", "imports.log"}
    e2e = json.loads((out / "gpu_e2e.json").read_text())
    points = e2e["points"]
    assert {(p["path"], p["rule"]) for p in points} == {(a, r) for a in ("triton", "torch") for r in (1, 2)}
    for p in points:
        assert p["rounds"] > 0 and p["forward_ms"] > 0 and p["kernel_ms"] > 0
        if p["rule"] == 2:   # q rows fetched when queued, as on the GPU
            assert p["prefetched"] == p["q_jobs"] > 0 and 0 <= p["q_hidden_share"] <= 1
    assert (out / "gpu_e2e.log").read_text().strip().splitlines()[-1].startswith("gpu_e2e: ")
