"""GPU benchmark of the fused Triton verify against the one-read HBM bound and a torch-native
pipeline, measured side by side in one run. Writes JSON; run by bench/gpu_check.sh.

    python3 bench/gpu_bench.py --out DIR [--budget-s 150] [--smoke] [--compile-json FILE]

Grid (the goal's neighbourhood first, V 128k bf16; the budget cuts the tail):
B in {1, 8, 64, 256}, M in {1, 4, 8, 16}, V in {32k, 128k, 256k}, bf16 and fp32 logits,
every proposal rule 2 with the default profile (T 1, no top-k/top-p); plus a filtered profile
(T 0.7, top-k 50, top-p 0.9) on a subset. Per point: microseconds (triton.testing.do_bench,
median), effective GB/s over the bytes that must be read once (all logits, q at x and one q
row per proposal), the ratio of our time to the one-read HBM bound (bytes / peak bandwidth;
the issue's goal is <= 1.5), the same against the copy bandwidth measured in this run, and
the speed-up over the torch-native pipeline (softmax over every row, sort-based top-k/top-p,
rejection and residual draw in torch: what a plain PyTorch verifier does).
With --compile-json (bench/gpu_compile.py's output, as bench/gpu_check.sh passes it) each
point also holds, per kernel, what the compiler made for this GPU's architecture and the
point's logits type (registers, spills, blocks per SM, widest load) beside the kernel's
measured time (torch.profiler, mean of 10 calls).
--smoke runs a few tiny points on the CPU (Triton interpreter) so the script is exercised
where there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

HBM_PEAK_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--budget-s", type=float, default=150.0, help="stop adding points after this")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (Triton interpreter)")
    ap.add_argument("--compile-json", type=Path,
                    help="bench/gpu_compile.py's gpu_compile.json: its figures go beside each point's times")
    return ap.parse_args()


ARGS = parse_args()
if ARGS.smoke:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
from sdcp_fast.kernels import VerifyBatch, verify  # noqa: E402


def make_case(b: int, m: int, vocab: int, dtype: torch.dtype, device: torch.device,
              profile: tuple[int, int, int]) -> tuple[VerifyBatch, dict]:
    """B proposals of M tokens each, all rule 2, drafts drawn near the target."""
    gen = torch.Generator(device=device).manual_seed(b * 1000 + m * 10 + vocab % 97)
    rows = b * (m + 1)
    logits = (torch.randn(rows, vocab, device=device, generator=gen) * 2.0).to(dtype)
    view = logits.view(b, m + 1, vocab)
    q = torch.softmax(view[:, :m].float() + 0.5 * torch.randn(b, m, vocab, device=device, generator=gen), dim=-1)
    tokens = torch.multinomial(q.view(-1, vocab), 1, generator=gen).view(b, m)
    acc_u = torch.rand(b, m, device=device, dtype=torch.float64, generator=gen)
    extra_u = torch.rand(b, m + 1, device=device, dtype=torch.float64, generator=gen)
    i64 = dict(dtype=torch.int64, device=device)
    ar = torch.arange(b, **i64)
    t, k, p = profile
    batch = VerifyBatch(
        logits=logits, draft_tokens=tokens.reshape(-1), num_draft=torch.full((b,), m, **i64),
        rule=torch.full((b,), 2, **i64), temperature_milli=torch.full((b,), t, **i64),
        top_k=torch.full((b,), k, **i64), top_p_milli=torch.full((b,), p, **i64),
        q=q.view(-1, vocab), q_start=ar * m, accept_uniforms=acc_u.reshape(-1),
        extra_uniforms=extra_u.reshape(-1), row_start=ar * (m + 1), token_start=ar * m)
    native_inputs = dict(logits=view, q=q, tokens=tokens, acc_u=acc_u, extra_u=extra_u)
    return batch, native_inputs


def torch_native(logits, q, tokens, acc_u, extra_u, profile):
    """A plain PyTorch verifier: materialised p, sort-based filters, rejection, residual draw."""
    t, k, p_milli = profile
    b, m1, vocab = logits.shape
    m = m1 - 1
    x = logits.float() / (t / 1000.0)
    if (0 < k < vocab) or p_milli < 1000:
        sx, idx = torch.sort(x, dim=-1, descending=True, stable=True)
        drop = torch.zeros_like(sx, dtype=torch.bool)
        if 0 < k < vocab:
            drop[..., k:] = True
        if p_milli < 1000:
            sp = torch.softmax(sx.masked_fill(drop, float("-inf")), dim=-1)
            drop |= (torch.cumsum(sp, dim=-1) - sp) >= p_milli / 1000.0
        x = torch.full_like(x, float("-inf")).scatter(-1, idx, sx.masked_fill(drop, float("-inf")))
    probs = torch.softmax(x, dim=-1)
    px = probs[:, :m].gather(-1, tokens[..., None])[..., 0]
    qx = q.gather(-1, tokens[..., None])[..., 0]
    accept = acc_u < (px / qx).clamp(max=1.0).double()
    a = torch.cumprod(accept.to(torch.int64), dim=1).sum(dim=1)
    ar = torch.arange(b, device=logits.device)
    target = probs[ar, a]
    q_at = q[ar, a.clamp(max=m - 1)]
    residual = (target - q_at).clamp(min=0.0)
    use_res = (a < m) & (residual.sum(-1) > 0)
    w = torch.where(use_res[:, None], residual, target)
    cdf = torch.cumsum(w, dim=-1, dtype=torch.float64)
    u = extra_u[ar, a] * cdf[:, -1]
    return a, torch.searchsorted(cdf, u[:, None], right=True)[:, 0]


def bench_ms(fn, device: torch.device) -> float:
    if device.type == "cuda":
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median"))
    start = time.perf_counter()   # the interpreter: no compile to warm up, one call is enough
    fn()
    return 1e3 * (time.perf_counter() - start)


def copy_gbps(device: torch.device) -> float:
    n = (1 << 30) // 4 if device.type == "cuda" else (1 << 24) // 4
    src = torch.empty(n, device=device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device)
    return 2 * n * 4 / (ms * 1e-3) / 1e9  # read + write


def peak_gbps(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in HBM_PEAK_GBPS.items() if k in name), None)


def compile_predictions(path: Path | None, arch: int | None) -> dict[str, dict[str, dict]]:
    """What bench/gpu_compile.py read from the compiled kernels for `arch` (the first target
    when None), by logits type ("*bf16", ...) and kernel: registers, spills, blocks per SM,
    widest global load in bits. Empty without the file."""
    if path is None or not path.exists():
        return {}
    targets = json.loads(path.read_text())["targets"]
    target = next((t for t in targets if arch is None or t["gpu"]["arch"] == arch), None)
    by_type: dict[str, dict[str, dict]] = {}
    for f in (target or {"facts": []})["facts"]:
        if f["error"] is None and "logits_ptr" in f["signature"]:
            by_type.setdefault(f["signature"]["logits_ptr"], {})[f["kernel"]] = dict(
                registers=f["registers"], spills=f["spills"], blocks_per_sm=f["blocks_per_sm"],
                num_warps=f["num_warps"], widest_load_bits=max(map(int, f["load_bits"]), default=0))
    return by_type


def kernel_times_us(fn, device: torch.device, names) -> dict[str, float] | str | None:
    """Mean GPU time per call of each kernel in `names` over 10 calls of fn (torch.profiler);
    None on the CPU, the error's text if the profiler fails (the point is kept)."""
    if device.type != "cuda" or not names:
        return None
    try:
        from torch.profiler import ProfilerActivity, profile
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
        times = {}
        for event in prof.key_averages():
            total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
            if event.key in names and event.count:
                times[event.key] = round(total / event.count, 2)
        return times
    except Exception as error:  # noqa: BLE001 - a profiler problem must not lose the point
        return f"{type(error).__name__}: {error}"


def main() -> int:
    device = torch.device("cuda" if torch.cuda.is_available() and not ARGS.smoke else "cpu")
    if device.type != "cuda" and not ARGS.smoke:
        print("no CUDA device: the full grid needs a GPU (use --smoke here)", file=sys.stderr)
        return 2
    plain, filtered = (1000, 0, 1000), (700, 50, 900)
    if ARGS.smoke:
        order = [("plain", plain, p) for p in ((1, 1, 300, "bf16"), (3, 4, 300, "bf16"))]
        order.append(("filtered", filtered, (1, 2, 300, "fp32")))
    else:
        # the goal's point (B 64, M 8, V 128k, bf16) and its neighbours first: the budget
        # must not cut them
        first = [(b, m, 131_072, "bf16") for b in (64, 8, 1, 256) for m in (8, 4, 1, 16)]
        rest = [(b, m, v, dt) for v in (131_072, 32_768, 262_144) for dt in ("bf16", "fp32")
                for b in (1, 8, 64, 256) for m in (1, 4, 8, 16)]
        order = ([("plain", plain, p) for p in first]
                 + [("filtered", filtered, (b, 4, 131_072, "bf16")) for b in (64, 8, 1)]
                 + [("plain", plain, p) for p in rest if p not in first])
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    arch = None
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        arch = major * 10 + minor
    predictions = compile_predictions(ARGS.compile_json, arch)
    peak = peak_gbps(device)
    copy = copy_gbps(device)
    started = time.perf_counter()
    results, skipped = [], []
    report = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        torch=torch.__version__, python=sys.version.split()[0], smoke=ARGS.smoke,
        hbm_peak_gbps=peak, copy_gbps_read_plus_write=round(copy, 1),
        seconds=0.0, points=results, skipped_for_time=skipped)
    if ARGS.compile_json is not None and ARGS.compile_json.exists():
        report["gpu_compile"] = json.loads(ARGS.compile_json.read_text())["summary"]
    try:
        import triton
        report["triton"] = triton.__version__
    except ImportError:
        pass
    ARGS.out.mkdir(parents=True, exist_ok=True)
    for profile_name, profile, (b, m, vocab, dt) in order:
        if time.perf_counter() - started > ARGS.budget_s:
            skipped.append(dict(profile=profile_name, B=b, M=m, V=vocab, dtype=dt))
            continue
        batch, nat = make_case(b, m, vocab, dtypes[dt], device, profile)
        ours = verify(batch, path="triton")
        ref_a, _ = torch_native(**nat, profile=profile)
        # acceptance must agree with the native pipeline except rare fp32-boundary cases
        agree = float((ours.accepted == ref_a).double().mean())
        ours_ms = bench_ms(lambda batch=batch: verify(batch, path="triton"), device)
        native_ms = bench_ms(lambda nat=nat, profile=profile: torch_native(**nat, profile=profile), device)
        needed = (batch.logits.numel() * batch.logits.element_size()
                  + b * vocab * 4 + b * m * 4)
        gbps = needed / (ours_ms * 1e-3) / 1e9
        point = dict(profile=profile_name, B=b, M=m, V=vocab, dtype=dt, us=round(ours_ms * 1e3, 2),
                     native_us=round(native_ms * 1e3, 2), gbps=round(gbps, 1),
                     bytes=needed, speedup_vs_native=round(native_ms / ours_ms, 2),
                     ratio_to_copy_read=round((needed / (copy / 2 * 1e9)) / (ours_ms * 1e-3), 3),
                     accept_agreement_with_native=round(agree, 4))
        if peak:
            point["ratio_to_hbm_bound"] = round((ours_ms * 1e-3) / (needed / (peak * 1e9)), 2)
        predicted = predictions.get("*" + dt, {})
        if predicted:   # the compiler's figures beside the measured time of each kernel
            measured = kernel_times_us(lambda batch=batch: verify(batch, path="triton"), device, set(predicted))
            point["kernels"] = {name: {**facts, "us": measured.get(name) if isinstance(measured, dict) else None}
                                for name, facts in sorted(predicted.items())}
            if isinstance(measured, str):
                point["kernel_times_error"] = measured
        results.append(point)
        print(json.dumps(point), flush=True)
        # after every point: a run cut by the check's time limit keeps what it measured
        report["seconds"] = round(time.perf_counter() - started, 1)
        (ARGS.out / "gpu_bench.json").write_text(json.dumps(report, indent=1))
        del batch, nat
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report["seconds"] = round(time.perf_counter() - started, 1)
    (ARGS.out / "gpu_bench.json").write_text(json.dumps(report, indent=1))
    print(summary(results, skipped))
    return 0


def summary(points: list[dict], skipped: list[dict]) -> str:
    """One line: the goal's point (B 64, M 8, V 128k, bf16) if measured, else the largest."""
    head = f"gpu_bench: {len(points)} points, {len(skipped)} skipped"
    plain = [p for p in points if p["profile"] == "plain"]
    goal = next((p for p in plain if (p["B"], p["M"], p["V"], p["dtype"]) == (64, 8, 131_072, "bf16")), None)
    p = goal or max(plain, key=lambda p: (p["V"], p["B"], p["M"]), default=None)
    if p is None:
        return head
    line = (f"{head}; B={p['B']} M={p['M']} V={p['V']} {p['dtype']}: {p['us']} us, {p['gbps']} GB/s, "
            f"{p['speedup_vs_native']}x torch-native")
    if "ratio_to_hbm_bound" in p:
        line += f", {p['ratio_to_hbm_bound']}x the one-read HBM bound (goal <= 1.5)"
    return line


if __name__ == "__main__":
    sys.exit(main())
