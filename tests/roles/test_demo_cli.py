"""`sdcp-fast demo`, the README's main job, end to end as a user runs it (small sizes)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest


@pytest.mark.timeout(120)
@pytest.mark.parametrize("protocol", ["h2", "h3"])
def test_demo_runs_and_cleans_up(tmp_path, protocol):
    workdir = tmp_path / "demo"
    done = subprocess.run(
        [sys.executable, "-m", "sdcp_fast.cli", "demo", "--pair", "tiny", "--prompts", "2", "--max-new", "24",
         "--protocol", protocol, "--workdir", str(workdir), "--plot", str(tmp_path / "p.png")],
        capture_output=True, text=True, timeout=110, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "outputs identical to the target's greedy decoding: 2/2" in out
    assert re.search(r"speedup \(wall clock, all prompts\): \d+\.\d\dx over batched", out)
    assert re.search(r"^\s+all\s+48\s", out, re.MULTILINE)           # 2 prompts x 24 tokens
    # the plot of accepted tokens and m_cap per round (matplotlib is in the dev extra)
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # every instance wrote its ready file and its log, and none is left running
    for name in ("router", "verifier", "drafter-1", "drafter-2"):
        assert (workdir / f"{name}.ready").is_file()
        pid = int(json.loads((workdir / f"{name}.ready").read_text())["pid"])
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid), f"{name} still running"


@pytest.mark.timeout(150)
def test_demo_with_two_routers_survives_the_first_one_killed(tmp_path):
    """`sdcp-fast demo --routers 2`: the router the client streams from is killed once every
    prompt is under way; router-2 takes the sessions over, the streams resume there, and
    the outputs are still the target's greedy decoding."""
    done = subprocess.run(
        [sys.executable, "-m", "sdcp_fast.cli", "demo", "--pair", "tiny", "--prompts", "2", "--max-new", "96",
         "--routers", "2", "--workdir", str(tmp_path / "demo")],
        capture_output=True, text=True, timeout=140, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "killed router (SIGKILL)" in out
    taken = re.findall(r"taken over by router-2 (\d+\.\d+) s after the kill \(lease TTL 2 s\); "
                       r"the stream resumed at token \d+", out)
    assert len(taken) == 2 and all(float(t) <= 4.0 for t in taken), out[-2000:]
    assert "outputs identical to the target's greedy decoding: 2/2" in out


def _zombie(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] == "Z"
    except OSError:
        return True
