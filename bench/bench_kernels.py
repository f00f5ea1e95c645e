"""Verify throughput on the CPU: the native op (csrc/), kernels/cpu.py and a one-thread memcpy
of the same bytes, side by side in one run.

    .venv/bin/python bench/bench_kernels.py            # the grid below (a few minutes)
    .venv/bin/python bench/bench_kernels.py --quick    # the goal points only (B 8, M 8)
    .venv/bin/python bench/bench_kernels.py --isa avx2 # the native op on its AVX2 loops

What is timed: `sdcp_fast.kernels.verify(batch, path)` for path "native" and "cpu" on B
proposals of M draft tokens, all rule 2, fp32 logits (randn * 2), drafts drawn from q near p
(realistic acceptance chains); the default profile (T 1, no top-k / top-p: every row needs
its full sum of exp), a filtered one (top-k 50, top-p 0.9, T 0.7) and top-p 0.9 alone.
Bytes: what the op must read at least once, all logits (R = B (M + 1) rows x V x 4 B) plus
one q row per proposal. memcpy: `ctypes.memmove` of that many bytes between two preallocated
buffers (one thread); every GB/s counts each byte once, so ratio = native GB/s / memcpy GB/s
= memcpy time / native time. Goals (issue 15): ratio >= 0.5 for the default profile and
>= 0.3 for the filtered one at B 8, M 8, V 32k and 128k, one thread.
Threads: native, cpu and memcpy run interleaved round by round at torch.set_num_threads(1)
(medians over --repeats rounds, after one warm-up; --clock thread times them by the calling
thread's CPU time, which a busy machine disturbs less); the scaling column is native's wall
time at 1 thread over 2 threads. The load average is printed at start and end: the development machine is
shared, so a busy second core shows up in the 2-thread figures first.
The last line (SUMMARY) is meant for scripts.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

import torch
from sdcp_fast.kernels import ProposalInput, build_batch, native, verify

DEFAULT = {}
FILTERED = {"temperature_milli": 700, "top_k": 50, "top_p_milli": 900}
TOP_P_ONLY = {"top_p_milli": 900}
PROFILES = {"default": DEFAULT, "top-k 50 top-p 0.9 T 0.7": FILTERED, "top-p 0.9": TOP_P_ONLY}


def make_batch(vocab: int, b: int, m: int, sampling: dict):
    gen = torch.Generator().manual_seed(vocab + 31 * b + m)
    rows = b * (m + 1)
    logits = torch.randn(rows, vocab, generator=gen) * 2.0
    q = torch.empty(b * m, vocab)
    props = []
    for i in range(b):
        lg = logits[i * (m + 1): i * (m + 1) + m]
        q[i * m: (i + 1) * m] = torch.softmax(lg + 0.5 * torch.randn(lg.shape, generator=gen), -1)
        tokens = torch.multinomial(q[i * m: (i + 1) * m], 1, generator=gen)[:, 0].tolist()
        props.append(ProposalInput(
            rule=2, tokens=tokens,
            accept_uniforms=torch.rand(m, generator=gen, dtype=torch.float64).tolist(),
            extra_uniforms=torch.rand(m + 1, generator=gen, dtype=torch.float64).tolist(),
            sampling=sampling))
    return build_batch(logits, props, q)


def needed_bytes(batch) -> int:
    rows, vocab = batch.logits.shape
    return rows * vocab * batch.logits.element_size() + batch.num_proposals * vocab * 4


CLOCK = {"wall": time.perf_counter, "thread": time.thread_time}
clock = CLOCK["wall"]


def timed(fn) -> float:
    start = clock()
    fn()
    return clock() - start


def measure(batch, repeats: int, with_cpu: bool) -> dict[str, float]:
    """Seconds per call: medians of native, cpu (optional) and memcpy at 1 thread on the chosen
    clock, interleaved round by round; then native at 1 and 2 threads on the wall clock (a
    thread clock misses the second thread), for the scaling column."""
    nbytes = needed_bytes(batch)
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)

    def memcpy():
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)

    fns = {"native": lambda: verify(batch, "native"), "memcpy": memcpy}
    if with_cpu:
        fns["cpu"] = lambda: verify(batch, "cpu")
    times: dict[str, list[float]] = {k: [] for k in fns}
    torch.set_num_threads(1)
    for fn in fns.values():
        fn()  # warm-up (and the first touch of dst)
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(timed(fn))
    out = {name: statistics.median(ts) for name, ts in times.items()}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        fns["native"]()
        start = time.perf_counter()
        for _ in range(repeats):
            fns["native"]()
        out[f"wall{threads}"] = (time.perf_counter() - start) / repeats
    torch.set_num_threads(1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="only the goal points (B 8, M 8)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--vocab", type=int, nargs="+", default=[32_768, 131_072])
    ap.add_argument("--no-cpu", action="store_true", help="skip kernels/cpu.py (faster)")
    ap.add_argument("--isa", choices=["auto", "avx2", "scalar"], default="auto",
                    help="cap the native op's row loops (SDCP_NATIVE_ISA); auto = the best the CPU has")
    ap.add_argument("--clock", choices=sorted(CLOCK), default="wall",
                    help="thread: CPU time of the calling thread, steadier on a shared machine")
    args = ap.parse_args()
    global clock
    clock = CLOCK[args.clock]
    if args.isa != "auto":
        os.environ["SDCP_NATIVE_ISA"] = args.isa
    if not native.available():
        raise SystemExit(f"native op unavailable: {native.unavailable_reason()}")

    points = []  # (profile name, V, B, M)
    for vocab in args.vocab:
        shapes = [(8, 8)] if args.quick else [(1, 4), (1, 8), (8, 4), (8, 8), (32, 4), (32, 8)]
        points += [("default", vocab, b, m) for b, m in shapes]
        points += [("top-k 50 top-p 0.9 T 0.7", vocab, 8, 8)]
        if not args.quick:
            points += [("top-p 0.9", vocab, 8, 8)]

    print(f"[kernels] native loops: {native.capability()}; {args.clock} clock; torch "
          f"{torch.__version__}; load average {os.getloadavg()[0]:.2f}")
    print(f"{'profile':<26}{'V':>7}{'B':>4}{'M':>3} {'MB':>6} | {'native ms':>9} {'GB/s':>6} "
          f"{'ratio':>6} | {'cpu.py ms':>9} {'GB/s':>6} {'ratio':>6} | {'memcpy GB/s':>11} | "
          f"{'native x cpu':>12} | {'2 thr ms':>8} {'scaling':>7}")
    results = []
    for profile, vocab, b, m in points:
        batch = make_batch(vocab, b, m, PROFILES[profile])
        t = measure(batch, args.repeats, not args.no_cpu)
        nbytes = needed_bytes(batch)
        gbps = {k: nbytes / v / 1e9 for k, v in t.items()}
        ratio = t["memcpy"] / t["native"]
        cpu_cols = (f"{t['cpu'] * 1e3:9.2f} {gbps['cpu']:6.2f} {t['memcpy'] / t['cpu']:6.3f}"
                    if "cpu" in t else f"{'-':>9} {'-':>6} {'-':>6}")
        speedup = t["cpu"] / t["native"] if "cpu" in t else float("nan")
        scaling = t["wall1"] / t["wall2"]
        print(f"{profile:<26}{vocab:>7}{b:>4}{m:>3} {nbytes / 2**20:6.1f} | "
              f"{t['native'] * 1e3:9.3f} {gbps['native']:6.2f} {ratio:6.3f} | {cpu_cols} | "
              f"{gbps['memcpy']:11.2f} | {speedup:11.1f}x | {t['wall2'] * 1e3:8.3f} "
              f"{scaling:6.2f}x", flush=True)
        results.append((profile, vocab, b, m, ratio, speedup, scaling))

    goal = {r[1]: r[4] for r in results if r[0] == "default" and (r[2], r[3]) == (8, 8)}
    goal_f = {r[1]: r[4] for r in results if r[0] == FILTER_NAME and (r[2], r[3]) == (8, 8)}
    met = all(v >= 0.5 for v in goal.values()) and all(v >= 0.3 for v in goal_f.values())
    speedups = [r[5] for r in results if r[5] == r[5]]
    scalings = [r[6] for r in results]
    print(f"[kernels] load average at the end {os.getloadavg()[0]:.2f}")
    print(f"SUMMARY bench_kernels ({native.capability()} loops, {args.clock} clock): "
          "native/memcpy at B8 M8 default "
          + " ".join(f"V{v}={r:.2f}" for v, r in goal.items()) + " (goal >= 0.5), filtered "
          + " ".join(f"V{v}={r:.2f}" for v, r in goal_f.items()) + " (goal >= 0.3); "
          + (f"native vs cpu.py median {statistics.median(speedups):.1f}x; " if speedups else "")
          + f"2-thread scaling median {statistics.median(scalings):.2f}x; "
          + f"goals {'met' if met else 'NOT met'}")


FILTER_NAME = "top-k 50 top-p 0.9 T 0.7"

if __name__ == "__main__":
    main()
