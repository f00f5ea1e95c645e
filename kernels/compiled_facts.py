"""Compile one recorded launch (compile_target.py) for its GPU and read what the compiler made:
registers per thread, spills, stack, shared memory, the widths of the global loads, and how
many blocks of the launch's warps fit on one multiprocessor.

The figures come from the compiler itself, not from a model of it: ptxas's own `-v` report
of the compile (Triton runs ptxas with -v; `knobs.nvidia.dump_ptxas_log` prints it) for
registers and spill bytes, Triton's metadata for the shared memory it allocates, and the
SASS of the cubin (the wheel's cuobjdump) for the loads: `LDG.E.128` is a 128-bit vector
load, `LDG.E.64` a 64-bit one, `LDG.E` 32 bits. ptxas only reports what it compiles, so the
caller points Triton's cache at an empty folder (`fresh_cache`).

Occupancy is bounded by the register file (64K 32-bit registers per multiprocessor on sm_90
and sm_100, allocated per warp in units of 256), by 64 resident warps, by 32 resident blocks
and by 228 KiB of shared memory (1 KiB of it reserved per block).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import triton
from triton import knobs
from triton.compiler import ASTSource

from .compile_target import RecordedLaunch

REGISTERS_PER_SM = 65536
REGISTER_ALLOCATION_UNIT = 256  # registers, per warp
WARPS_PER_SM = 64
BLOCKS_PER_SM = 32
SHARED_BYTES_PER_SM = 228 * 1024
SHARED_RESERVED_PER_BLOCK = 1024

_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_LOAD = re.compile(r"\bLDG(\.[A-Z0-9_]+)*")
_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/", re.MULTILINE)


@dataclass(frozen=True)
class CompiledFacts:
    """What one specialisation of one kernel compiled to on one architecture; `error` holds
    the compiler's message when it refused the program (the other figures are then 0)."""

    kernel: str
    arch: int
    signature: dict[str, str]
    constexprs: dict[str, object]
    num_warps: int
    registers: int = 0
    spill_store_bytes: int = 0
    spill_load_bytes: int = 0
    stack_bytes: int = 0
    shared_bytes: int = 0
    cubin_bytes: int = 0
    load_bits: dict[int, int] = field(default_factory=dict)  # global-load width in bits -> count in SASS
    local_memory_ops: int = 0  # LDL/STL in SASS: spill or stack traffic
    instructions: int = 0  # SASS instructions (the cubin's size is mostly these and line info)
    error: str | None = None

    @property
    def spills(self) -> int:
        return self.spill_store_bytes + self.spill_load_bytes

    @property
    def widest_load_bits(self) -> int:
        return max(self.load_bits, default=0)

    @property
    def blocks_per_sm(self) -> int:
        """Resident blocks of this launch per multiprocessor (0 for a failed compile)."""
        if self.error is not None:
            return 0
        per_warp = -(-max(self.registers, 1) * 32 // REGISTER_ALLOCATION_UNIT) * REGISTER_ALLOCATION_UNIT
        by_registers = REGISTERS_PER_SM // (per_warp * self.num_warps)
        by_shared = SHARED_BYTES_PER_SM // (self.shared_bytes + SHARED_RESERVED_PER_BLOCK)
        return min(by_registers, by_shared, WARPS_PER_SM // self.num_warps, BLOCKS_PER_SM)


@contextmanager
def fresh_cache() -> Iterator[str]:
    """Triton's cache in an empty temporary folder for the block: every launch compiles, so
    ptxas reports on every one."""
    previous = knobs.cache.dir
    with tempfile.TemporaryDirectory(prefix="sdcp-compile-") as folder:
        knobs.cache.dir = folder
        try:
            yield folder
        finally:
            knobs.cache.dir = previous


def _named_constexprs(launch: RecordedLaunch) -> dict[str, object]:
    names = list(launch.signature)
    return {names[path[0]]: value for path, value in launch.constexprs.items()}


def load_widths(sass: str) -> Counter[int]:
    """Count of global loads by width in bits in a SASS listing (LDG.E.128 -> 128,
    LDG.E.U8 -> 8, LDG.E -> 32)."""
    widths: Counter[int] = Counter()
    for match in _LOAD.finditer(sass):
        suffixes = match.group(0).split(".")[1:]
        bits = 32
        for suffix in suffixes:
            if suffix.isdigit():
                bits = int(suffix)
            elif suffix[:1] in "US" and suffix[1:].isdigit():
                bits = int(suffix[1:])
        widths[bits] += 1
    return widths


def disassemble(cubin: bytes) -> str:
    """The SASS of a cubin, by the cuobjdump that ships with Triton."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as handle:
        handle.write(cubin)
    try:
        return subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", handle.name], check=True,
                              capture_output=True, text=True).stdout
    finally:
        os.unlink(handle.name)


def compile_launch(launch: RecordedLaunch) -> CompiledFacts:
    """Compile `launch` for its target (within `fresh_cache`) and read the result."""
    base = dict(kernel=launch.name, arch=int(launch.target.arch), signature=launch.signature,
                constexprs=_named_constexprs(launch), num_warps=int(launch.options["num_warps"]))
    report = io.StringIO()
    previous = knobs.nvidia.dump_ptxas_log
    knobs.nvidia.dump_ptxas_log = True
    try:
        with contextlib.redirect_stdout(report):
            compiled = triton.compile(ASTSource(launch.kernel, launch.signature, launch.constexprs, launch.attrs),
                                      target=launch.target, options=dict(launch.options))
    except Exception as error:  # noqa: BLE001 - any refusal of the compiler is the finding
        return CompiledFacts(**base, error=f"{type(error).__name__}: {error}"[:2000])
    finally:
        knobs.nvidia.dump_ptxas_log = previous
    log = report.getvalue()
    registers, spills = _REGISTERS.search(log), _SPILLS.search(log)
    if registers is None or spills is None:
        return CompiledFacts(**base, error=f"no ptxas report (a cached compile?): {log[:500]!r}")
    sass = disassemble(compiled.asm["cubin"])
    return CompiledFacts(
        **base, registers=int(registers.group(1)), stack_bytes=int(spills.group(1)),
        spill_store_bytes=int(spills.group(2)), spill_load_bytes=int(spills.group(3)),
        shared_bytes=int(compiled.metadata.shared), cubin_bytes=len(compiled.asm["cubin"]),
        load_bits=dict(sorted(load_widths(sass).items())),
        local_memory_ops=len(re.findall(r"\b(?:LDL|STL)\b", sass)),
        instructions=len(_INSTRUCTION.findall(sass)))
