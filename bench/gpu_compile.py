"""Compile every Triton kernel of kernels/ for sm_90 (H100/H200) and sm_100 (B200) as the
launchers specialise it, without a GPU, and report what the compiler made. Prints a table
and one summary line; writes gpu_compile.json to --out.

    python bench/gpu_compile.py [--out DIR] [--gpu sm90 --gpu sm100 | --gpu device]
                                [--sweep full|ci|quick|none] [--plant FILE.py] [--jobs N]

The launches come from kernels/compile_sweep.py (the launchers run on meta tensors under a
compile-only target, kernels/compile_target.py); each distinct specialisation is compiled
once per target, afresh, and read by kernels/compiled_facts.py. --sweep ci and quick sample
the batch shapes (compile_sweep.SWEEPS; the configurations of every row count are still
covered), none leaves only the planted launches; --gpu device takes the architecture and
multiprocessor count of the CUDA device present (bench/gpu_check.sh); --plant FILE adds the
launches of FILE's `launch_on_meta()` and its kernels to the check
(tests/kernels/planted_kernel.py). Exit status 0 only when every kernel of kernels/ (and
of FILE) compiled, without a failure or a spill, with at least MIN_BLOCKS_PER_SM blocks per
multiprocessor.

Triton must compile here, not interpret: TRITON_INTERPRET is dropped before it is imported.
"""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported, here and in the workers

import argparse  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from concurrent.futures import ProcessPoolExecutor  # noqa: E402
from dataclasses import asdict  # noqa: E402
from pathlib import Path  # noqa: E402

MIN_BLOCKS_PER_SM = 2
GPU_KEYS = {"sm90": 0, "sm100": 1}  # index into compile_sweep.GPU_MODELS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="folder for gpu_compile.json")
    ap.add_argument("--gpu", action="append", choices=[*GPU_KEYS, "device"],
                    help="target(s); default sm90 and sm100")
    ap.add_argument("--sweep", choices=["full", "ci", "quick", "none"], default="full",
                    help="the batch shapes: all, samples (kernels/compile_sweep.py), or none")
    ap.add_argument("--plant", type=Path, help="a file whose launch_on_meta() launches more kernels")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    return ap.parse_args(argv)


def _load_plant(path: Path | None):
    if path is None:
        return None
    spec = importlib.util.spec_from_file_location(f"planted_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # Triton looks kernels' modules up by name
    spec.loader.exec_module(module)
    return module


def _gpu_model(key: str):
    from sdcp_fast.kernels import compile_sweep
    if key != "device":
        return compile_sweep.GPU_MODELS[GPU_KEYS[key]]
    import torch
    from triton.backends.compiler import GPUTarget
    major, minor = torch.cuda.get_device_capability(0)
    props = torch.cuda.get_device_properties(0)
    return compile_sweep.GpuModel(props.name, GPUTarget("cuda", major * 10 + minor, 32), props.multi_processor_count)


def check_gpu(key: str, sweep: str, plant: Path | None) -> dict:
    """Record, compile and read every specialisation for one GPU (runs in a worker)."""
    from sdcp_fast.kernels import compile_sweep, compiled_facts

    gpu = _gpu_model(key)
    planted = _load_plant(plant)
    started = time.perf_counter()
    proposal_counts, draft_counts = compile_sweep.SWEEPS.get(sweep, ((), ()))
    launches, calls = compile_sweep.record_gpu(
        gpu, proposal_counts=proposal_counts, draft_counts=draft_counts,
        vocabs=compile_sweep.VOCABS if sweep != "none" else (),
        extra_launches=planted.launch_on_meta if planted else None)
    recorded = time.perf_counter()
    with compiled_facts.fresh_cache():
        facts = [compiled_facts.compile_launch(launch) for launch in launches]
    compiled = time.perf_counter()

    sources = sorted(Path(compile_sweep.__file__).parent.glob("*.py"))  # Python modules, not the native op
    modules = [importlib.import_module(f"{compile_sweep.__package__}.{p.stem}") for p in sources if p.stem != "__init__"]
    functions = compile_sweep.jit_functions((modules if sweep != "none" else []) + ([planted] if planted else []))
    missing = compile_sweep.never_compiled(functions, {f.kernel for f in facts if f.error is None})
    return {"gpu": {"name": gpu.name, "arch": int(gpu.target.arch), "sm_count": gpu.sm_count,
                    "launcher_calls": calls, "record_s": round(recorded - started, 1),
                    "compile_s": round(compiled - recorded, 1)},
            "facts": [{**asdict(f), "constexprs": {k: str(v) for k, v in f.constexprs.items()},
                       "blocks_per_sm": f.blocks_per_sm, "spills": f.spills} for f in facts],
            "never_compiled": missing}


def kernel_table(facts: list[dict]) -> list[dict]:
    """One row per (kernel, arch) over its specialisations: worst registers, spills and
    occupancy; the widest global load for each type of the first argument (the logits)."""
    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for f in facts:
        groups[(f["kernel"], f["arch"])].append(f)
    rows = []
    for (kernel, arch), group in sorted(groups.items()):
        ok = [f for f in group if f["error"] is None]
        widest: dict[str, int] = {}
        for f in ok:
            first = next(iter(f["signature"].values()))
            widest[first] = max(widest.get(first, 0), max(map(int, f["load_bits"]), default=0))
        rows.append({
            "kernel": kernel, "arch": arch, "specialisations": len(group), "failures": len(group) - len(ok),
            "registers_min": min((f["registers"] for f in ok), default=0),
            "registers_max": max((f["registers"] for f in ok), default=0),
            "spills": max((f["spills"] for f in ok), default=0),
            "stack_bytes": max((f["stack_bytes"] for f in ok), default=0),
            "shared_bytes": max((f["shared_bytes"] for f in ok), default=0),
            "num_warps": sorted({f["num_warps"] for f in group}),
            "blocks_per_sm": min((f["blocks_per_sm"] for f in ok), default=0),
            "cubin_kib_max": round(max((f["cubin_bytes"] for f in ok), default=0) / 1024),
            "widest_load_bits": widest})
    return rows


def _gist(error: str) -> str:
    """The line of a compiler error that says what is wrong (Triton's CompilationError puts
    it last, after the source excerpt)."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    return (lines[-1] if lines else error)[:300]


def summary_line(results: list[dict]) -> str:
    facts = [f for r in results for f in r["facts"]]
    kernels = {f["kernel"] for f in facts}
    per_target = sorted({sum(1 for f in r["facts"]) for r in results})
    failures = sum(f["error"] is not None for f in facts)
    registers = max((f["registers"] for f in facts), default=0)
    spills = sum(f["spills"] for f in facts)
    return (f"gpu compile: {len(kernels)} kernels x {'/'.join(map(str, per_target))} specialisations x "
            f"{len(results)} targets, {failures} failures, max registers {registers}, spills {spills}")


def print_table(rows: list[dict]) -> None:
    print(f"{'kernel':22} {'arch':>4} {'specs':>5} {'regs':>7} {'spill':>5} {'smem':>5} {'warps':>5} "
          f"{'blk/SM':>6} {'cubin':>6}  widest load (bits) by logits type")
    for row in rows:
        regs = f"{row['registers_min']}-{row['registers_max']}"
        loads = " ".join(f"{t}:{b}" for t, b in sorted(row["widest_load_bits"].items()))
        print(f"{row['kernel']:22} {row['arch']:>4} {row['specialisations']:>5} {regs:>7} {row['spills']:>5} "
              f"{row['shared_bytes']:>5} {','.join(map(str, row['num_warps'])):>5} {row['blocks_per_sm']:>6} "
              f"{row['cubin_kib_max']:>4}Ki  {loads}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    keys = args.gpu or list(GPU_KEYS)
    jobs = [(key, args.sweep, args.plant) for key in keys]
    if args.jobs > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(min(args.jobs, len(jobs)), mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(check_gpu, *zip(*jobs, strict=True)))
    else:
        results = [check_gpu(*job) for job in jobs]

    rows = kernel_table([f for r in results for f in r["facts"]])
    print_table(rows)
    for r in results:
        gpu = r["gpu"]
        print(f"{gpu['name']} (sm_{gpu['arch']}, {gpu['sm_count']} SMs): {gpu['launcher_calls']} launcher calls "
              f"recorded in {gpu['record_s']} s, {len(r['facts'])} specialisations compiled in {gpu['compile_s']} s")
        for name in r["never_compiled"]:
            print(f"never compiled for sm_{gpu['arch']}: {name}")
        for f in r["facts"]:
            if f["error"] is not None:
                print(f"FAILED {f['kernel']} sm_{f['arch']} {f['constexprs']}: {_gist(f['error'])}")
    facts = [f for r in results for f in r["facts"]]
    ok = (not any(r["never_compiled"] for r in results) and facts
          and all(f["error"] is None and f["spills"] == 0 and f["blocks_per_sm"] >= MIN_BLOCKS_PER_SM for f in facts))
    line = summary_line(results)
    if args.out is not None:
        import triton
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_compile.json").write_text(json.dumps({
            "command": " ".join(["python", "bench/gpu_compile.py", *(argv if argv is not None else sys.argv[1:])]),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
            "triton": triton.__version__, "seconds": round(time.perf_counter() - started, 1),
            "ok": bool(ok), "summary": line, "kernels": rows, "targets": results}, indent=1))
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
