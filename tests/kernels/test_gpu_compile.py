"""The Triton kernels compile for the GPUs they are written for, and the interpreter tests are
not the only evidence: every kernel of kernels/ compiles for sm_90 and sm_100 at every
specialisation its launchers produce (bench/gpu_compile.py, in a process of its own, since
this one interprets Triton), without a failure or a spill and with at least two blocks per
multiprocessor; a construct that the interpreter runs and the compiler refuses (planted in
planted_kernel.py) fails that check.

The test runs the "ci" sweep (every B, M in 1, 2, 3 and 16: the full sweep's
specialisations from a quarter of its launcher calls; bench/gpu_compile.py runs the full
one): about 50 s on 2 cores, both targets in parallel, so it is marked slow (CI runs it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_cases import interpreting
from sdcp_fast.kernels import ProposalInput, pack_batch, triton_path
from sdcp_fast.kernels.compile_sweep import (
    MAX_DRAFT,
    MAX_PROPOSALS,
    config_representatives,
    meta_batch,
    ragged_drafts,
)
from sdcp_fast.kernels.compiled_facts import CompiledFacts, load_widths

REPO = Path(__file__).resolve().parents[2]
PLANTED = Path(__file__).with_name("planted_kernel.py")
SUMMARY = re.compile(r"^gpu compile: (\d+) kernels x (\d+) specialisations x 2 targets, (\d+) failures, "
                     r"max registers (\d+), spills (\d+)$")


def run_gpu_compile(out: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    got = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_compile.py"), "--out", str(out), *args],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=560)
    return got, json.loads((out / "gpu_compile.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(600)   # under a minute on 2 cores; the margin is for a machine others load
def test_every_kernel_compiles_for_sm90_and_sm100_without_spills(tmp_path):
    got, report = run_gpu_compile(tmp_path, "--sweep", "ci")
    assert got.returncode == 0, got.stdout[-4000:] + got.stderr[-4000:]
    summary = SUMMARY.match(got.stdout.strip().splitlines()[-1])
    assert summary, got.stdout[-2000:]
    kernels, _, failures, registers, spills = map(int, summary.groups())
    assert (failures, spills) == (0, 0)
    assert {t["gpu"]["arch"] for t in report["targets"]} == {90, 100}
    for target in report["targets"]:
        assert target["never_compiled"] == []   # every jit function of kernels/ is or is in a compiled kernel
        launched = {f["kernel"] for f in target["facts"]}
        assert len(launched) == kernels and "_row_finalize_kernel" in launched
        for facts in target["facts"]:
            assert facts["error"] is None and facts["spills"] == 0 and facts["local_memory_ops"] == 0
            assert facts["blocks_per_sm"] >= 2 and 0 < facts["registers"] <= registers
        # every logits dtype, each its own specialisation of each kernel
        for kernel in launched:
            firsts = {f["signature"]["logits_ptr"] for f in target["facts"] if f["kernel"] == kernel}
            assert firsts == {"*fp32", "*bf16", "*fp16"}


@pytest.mark.slow
def test_a_construct_the_compiler_refuses_fails_the_check(tmp_path):
    got, report = run_gpu_compile(tmp_path, "--plant", str(PLANTED), "--sweep", "none")
    assert got.returncode == 1
    assert got.stdout.strip().splitlines()[-1].startswith("gpu compile: 1 kernels x 1 specialisations x 2 targets, "
                                                          "2 failures,")
    for target in report["targets"]:
        (facts,) = target["facts"]
        assert facts["kernel"] == "_planted_row_sum_kernel"
        assert "Loop-carried variable total" in facts["error"]
        assert target["never_compiled"] == ["_planted_row_sum_kernel"]


def test_the_interpreter_runs_the_planted_construct():
    if not interpreting():
        pytest.skip("the planted kernel does not compile: it is for the interpreter (TRITON_INTERPRET=1)")
    sys.path.insert(0, str(PLANTED.parent))
    import planted_kernel

    x = torch.randn(5, 1000, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(planted_kernel.row_sums(x), planted_kernel.row_sums_reference(x))


def test_recorded_batches_have_the_verifiers_layout():
    """The meta batch's views sit at the offsets of pack_batch's (the offsets decide which
    pointers Triton sees as 16-byte aligned)."""
    drafts = [2, 3, 1]
    logits = torch.zeros(sum(drafts) + len(drafts), 64)
    q = torch.full((sum(drafts), 64), 1 / 64)
    proposals = [ProposalInput(rule=2, tokens=[1] * m, accept_uniforms=[0.5] * m, extra_uniforms=0.5)
                 for m in drafts]
    real, meta = pack_batch(logits, proposals, q).unpack(), meta_batch(drafts, 64, torch.float32)
    for name in ("draft_tokens", "num_draft", "rule", "temperature_milli", "top_k", "top_p_milli", "q_start",
                 "row_start", "token_start", "accept_uniforms", "extra_uniforms"):
        assert getattr(meta, name).storage_offset() == getattr(real, name).storage_offset(), name
        assert getattr(meta, name).shape == getattr(real, name).shape, name


def test_ragged_batches_reach_every_row_count():
    for rows in range(2, MAX_PROPOSALS * (MAX_DRAFT + 1) + 1):
        drafts = ragged_drafts(rows)
        assert sum(drafts) + len(drafts) == rows and all(1 <= m <= MAX_DRAFT for m in drafts)
        assert len(drafts) <= MAX_PROPOSALS


def test_launch_config_for_a_gpu_that_is_not_here():
    cpu = torch.device("cpu")
    assert triton_path.launch_config(10, 32_000, cpu) == triton_path.launch_config_for(10, 32_000, None)
    h200 = triton_path.launch_config_for(1, 151_936, 132)
    assert (h200.block, h200.num_warps, h200.programs, h200.splits) == (1024, 8, 528, 64)
    assert triton_path.launch_config_for(2176, 151_936, 132).splits == 1
    configs = config_representatives(32_000, 132, 2176)
    assert {c.splits for c in configs} >= {1, 32} and all(c.block == 1024 for c in configs)


def test_load_widths_and_occupancy_arithmetic():
    sass = "LDG.E.128 R4, desc[UR4][R2.64] ;\nLDG.E.64 R8, ...\nLDG.E R1, ...\nLDG.E.U8 R0, ...\nSTG.E.128 ..."
    assert load_widths(sass) == {128: 1, 64: 1, 32: 1, 8: 1}
    facts = dict(kernel="k", arch=90, signature={}, constexprs={})
    assert CompiledFacts(**facts, num_warps=8, registers=128).blocks_per_sm == 2
    assert CompiledFacts(**facts, num_warps=8, registers=129).blocks_per_sm == 1
    assert CompiledFacts(**facts, num_warps=4, registers=32).blocks_per_sm == 16
    assert CompiledFacts(**facts, num_warps=8, registers=32, shared_bytes=100_000).blocks_per_sm == 2
    assert CompiledFacts(**facts, num_warps=4, error="refused").blocks_per_sm == 0
