"""An opt-in memory probe for a serving process: what grows, by allocation site and by type.

    SDCP_TRACEMALLOC=60 sdcp-fast serve verifier --config v1.toml
    SDCP_TRACEMALLOC=60 .venv/bin/python bench/bench_soak.py --clients 128 --minutes 4 --keep

With `SDCP_TRACEMALLOC=N` set, `sdcp-fast serve` starts `tracemalloc` (SDCP_TRACEMALLOC_FRAMES
frames per allocation, default 1) and, every N seconds and on SIGUSR2, logs one report
(logger `sdcp_fast.memprobe`): RSS, the bytes Python has traced, the largest allocation
sites, and the growth since the first report, by site and by object type (`gc.get_objects`):
the first report, N seconds in, is the baseline, so a soak's "after the first minute" is the
baseline with N = 60. The report lines start with `memprobe`, one fact a line. When
SDCP_TRACEMALLOC_DIR is set each report's snapshot is also dumped there (`tracemalloc.
Snapshot.load` reads it back) for a closer look. With SDCP_TRACEMALLOC_GARBAGE=1 each
report also collects the cyclic garbage and says what it was (by type, and where its
exceptions were raised), and counts the reachable exceptions and traceback chains (where
they begin and end, and what holds them).

Growth that tracemalloc does not show while RSS grows is memory Python freed that the C
allocator keeps (fragmentation, arenas per thread): the report says so by giving both.
Not for production: tracemalloc costs CPU on every allocation and counting objects walks
the whole heap.

SDCP_TRACEMALLOC_ROLES=router,verifier limits the probe to those roles (the others run
at their own speed). With SDCP_TRACEMALLOC_LIGHT=1 there is no tracemalloc (the process
runs at its own speed, so its RSS is what a soak measures): each report is one line of RSS, glibc's heap (in use,
free held, mmapped), Python's small-object allocator (pymalloc: its 1 MiB arenas, which
live outside glibc's heap, the bytes in use in them and the bytes free there), the blocks
Python has allocated and the threads. (It allocates nothing big itself: a list of every
object would be megabytes, and raise the heap it measures.)
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import os
import re
import signal
import sys
import tempfile
import threading
import time
import tracemalloc
import types
import warnings
from collections import Counter
from pathlib import Path

log = logging.getLogger("sdcp_fast.memprobe")
ENV = "SDCP_TRACEMALLOC"
TOP = 12
IGNORED = (tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
           tracemalloc.Filter(False, "<frozen importlib._bootstrap_external>"), tracemalloc.Filter(False, "<unknown>"))


def rss_mb() -> float:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_info() -> str:
    """glibc's view (mallinfo2, every arena): bytes in use and bytes free but held. Free
    bytes that grow while RSS grows and tracemalloc does not: fragmentation, not objects."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _MallInfo2
        m = libc.mallinfo2()
    except (OSError, AttributeError):
        return "malloc n/a"
    mb = 2**20
    return (f"malloc in use {m.uordblks / mb:.1f} MB, free held {m.fordblks / mb:.1f} MB, "
            f"heap {m.arena / mb:.1f} MB + mmap {m.hblkhd / mb:.1f} MB")


PYMALLOC_FIELDS = {"arenas allocated current": "arenas", "bytes in allocated blocks": "used",
                   "bytes in available blocks": "free"}


def pymalloc_info() -> str:
    """pymalloc's arenas (1 MiB mmaps each, outside glibc's heap) and the bytes used and free
    in them: arenas that grow while their used bytes do not are fragmentation (a few live
    objects hold each arena). Read from sys._debugmallocstats, which writes to fd 2."""
    stats = {}
    with tempfile.TemporaryFile("w+b") as out:
        saved = os.dup(2)
        try:
            os.dup2(out.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        for line in out.read().decode(errors="replace").splitlines():
            name, _, value = line.lstrip("# ").partition("=")
            key = PYMALLOC_FIELDS.get(name.strip())
            if key is not None and key not in stats:
                stats[key] = int(value.strip().replace(",", ""))
    if len(stats) < len(PYMALLOC_FIELDS):
        return "pymalloc n/a"
    mb = 2**20
    return (f"pymalloc {stats['arenas']} arenas, used {stats['used'] / mb:.1f} MB, "
            f"free {stats['free'] / mb:.1f} MB")


def arenas_info() -> str:
    """Every glibc arena (mallinfo2 sees only the main one): how many, the bytes the worker
    threads' arenas hold from the system, and the free bytes held in all of them. Read from
    malloc_info's XML."""
    try:
        libc = ctypes.CDLL(None)
        libc.fopen.restype = ctypes.c_void_p
        libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        libc.fclose.argtypes = [ctypes.c_void_p]
        libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
        with tempfile.NamedTemporaryFile() as out:
            stream = libc.fopen(out.name.encode(), b"w")
            if not stream:
                return "arenas n/a"
            libc.malloc_info(0, stream)
            libc.fclose(stream)
            xml = Path(out.name).read_text()
    except (OSError, AttributeError):
        return "arenas n/a"
    heaps = re.findall(r'<heap nr="(\d+)">(.*?)</heap>', xml, re.S)
    threads = sum(int(m) for nr, body in heaps if nr != "0"
                  for m in re.findall(r'<system type="current" size="(\d+)"', body))
    tail = xml.rsplit("</heap>", 1)[-1]
    free = sum(int(m) for m in re.findall(r'<total type="(?:fast|rest)" count="\d+" size="(\d+)"', tail))
    mb = 2**20
    return f"{len(heaps)} arenas, threads' arenas {threads / mb:.1f} MB, free in all {free / mb:.1f} MB"


def object_types() -> Counter:
    """How many objects of each type the garbage collector tracks (containers, instances)."""
    return Counter(type(o).__qualname__ for o in gc.get_objects())


class MemoryProbe:
    def __init__(self, interval_s: float, *, frames: int = 1, top: int = TOP, dump_dir: str | None = None,
                 role: str = "", light: bool = False):
        self.interval_s = interval_s
        self.light = light
        self.frames = frames
        self.top = top
        self.dump_dir = Path(dump_dir) if dump_dir else None
        self.role = role
        self.baseline: tracemalloc.Snapshot | None = None
        self.baseline_types: Counter | None = None
        self.baseline_rss = 0.0
        self.started = time.monotonic()
        self.reports = 0

    @classmethod
    def from_env(cls, role: str = "") -> MemoryProbe | None:
        value = os.environ.get(ENV, "").strip()
        roles = os.environ.get(ENV + "_ROLES", "").replace(",", " ").split()
        if not value or (roles and role not in roles):
            return None
        return cls(float(value), frames=int(os.environ.get(ENV + "_FRAMES", "1")),
                   dump_dir=os.environ.get(ENV + "_DIR") or None, role=role,
                   light=bool(os.environ.get(ENV + "_LIGHT")))

    def start(self) -> None:
        if self.light:
            log.info("memprobe on (light: no tracemalloc): a report every %.0f s", self.interval_s)
            return
        if not tracemalloc.is_tracing():
            tracemalloc.start(self.frames)
        with contextlib.suppress(NotImplementedError, RuntimeError):
            asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, lambda: self.report("SIGUSR2"))
        log.info("memprobe on: tracemalloc with %d frame(s), a report every %.0f s and on SIGUSR2",
                 self.frames, self.interval_s)

    async def run(self) -> None:
        """Report every interval until cancelled."""
        self.start()
        while True:
            await asyncio.sleep(self.interval_s)
            self.report("interval")

    def report(self, why: str) -> list[str]:
        """Log (and return) one report; the first one is the baseline of the later ones."""
        if self.light:
            return self.light_report(why)
        snapshot = tracemalloc.take_snapshot().filter_traces(IGNORED)
        types = object_types()
        rss, (traced, peak) = rss_mb(), tracemalloc.get_traced_memory()
        t = time.monotonic() - self.started
        lines = [f"memprobe t={t:.0f}s ({why}): rss {rss:.1f} MB, traced {traced / 2**20:.1f} MB "
                 f"(peak {peak / 2**20:.1f}), {malloc_info()}, {sum(types.values())} gc objects"]
        if self.baseline is None:
            self.baseline, self.baseline_types, self.baseline_rss = snapshot, types, rss
            lines += [f"memprobe top {_stat(s)}" for s in snapshot.statistics("lineno")[:self.top]]
            lines += [f"memprobe type {name}: {n}" for name, n in types.most_common(self.top)]
        else:
            base_traced = sum(s.size for s in self.baseline.statistics("filename"))
            now_traced = sum(s.size for s in snapshot.statistics("filename"))
            lines.append(f"memprobe since the baseline: rss {rss - self.baseline_rss:+.1f} MB, "
                         f"traced {(now_traced - base_traced) / 2**20:+.1f} MB")
            diff = snapshot.compare_to(self.baseline, "lineno")
            lines += [f"memprobe grew {_diff(s)}" for s in diff[:self.top] if s.size_diff > 0]
            grown = Counter({k: n - self.baseline_types.get(k, 0) for k, n in types.items()})
            lines += [f"memprobe type {name}: {n:+d} (now {types[name]})"
                      for name, n in grown.most_common(self.top) if n > 0]
        if os.environ.get(ENV + "_GARBAGE"):        # what only cycles keep (frees it: changes RSS)
            lines += cyclic_garbage(self.top) + live_exceptions(self.top)
        if self.dump_dir is not None:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            snapshot.dump(str(self.dump_dir / f"{self.role or 'sdcp'}-{os.getpid()}-{self.reports:03d}.tracemalloc"))
        self.reports += 1
        for line in lines:
            log.info("%s", line)
        return lines


    def light_report(self, why: str) -> list[str]:
        t = time.monotonic() - self.started
        line = (f"memprobe t={t:.0f}s ({why}): rss {rss_mb():.1f} MB, {malloc_info()}, {arenas_info()}, "
                f"{pymalloc_info()}, "
                f"{sys.getallocatedblocks()} blocks allocated, {threading.active_count()} threads")
        self.reports += 1
        log.info("%s", line)
        return [line]


def cyclic_garbage(top: int = TOP) -> list[str]:
    """What the cycle collector would free now (objects only reference cycles keep alive:
    e.g. an exception stored in a frame its own traceback holds), by type, and where the
    tracebacks among them were raised; then frees it. Such garbage lives until a full
    collection, which comes rarely in a process holding many objects."""
    flags = gc.get_debug()
    gc.set_debug(flags | gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        garbage, gc.garbage[:] = list(gc.garbage), []
    finally:
        gc.set_debug(flags)
    types = Counter(type(o).__qualname__ for o in garbage)
    raised = Counter()
    for o in garbage:
        if isinstance(o, BaseException) and o.__traceback__ is not None:
            raised[_raised(o)] += 1
    lines = [f"memprobe cyclic garbage: {len(garbage)} objects"]
    lines += [f"memprobe garbage type {name}: {n}" for name, n in types.most_common(top)]
    lines += [f"memprobe garbage exception {where}: {n}" for where, n in raised.most_common(top)]
    del garbage
    return lines


def live_exceptions(top: int = TOP) -> list[str]:
    """Exceptions still reachable (with their tracebacks, frames and locals), by where they
    were raised and caught, and what holds them."""
    objects = gc.get_objects()
    with warnings.catch_warnings():   # isinstance() on a deprecated module attribute (torch's) warns
        warnings.simplefilter("ignore")
        excs = [o for o in objects if isinstance(o, BaseException) and o.__traceback__ is not None]
        tbs = [o for o in objects if isinstance(o, types.TracebackType)]
    del objects                               # (a referrer of everything)
    where, holders = Counter(), Counter()
    for o in excs:
        where[_raised(o)] += 1
        for r in gc.get_referrers(o):
            if r is not excs:
                holders[type(r).__qualname__] += 1
    heads, tb_holders, longest = Counter(), Counter(), []
    linked = {id(tb.tb_next) for tb in tbs if tb.tb_next is not None}
    for tb in tbs:
        if id(tb) in linked:
            continue                          # not the head of its chain
        chain = [tb]
        while chain[-1].tb_next is not None:
            chain.append(chain[-1].tb_next)
        heads[f"{_frame(tb)} -> {_frame(chain[-1])}"] += 1
        if len(chain) > len(longest):
            longest = chain
        for r in gc.get_referrers(tb):
            if r is not tbs:
                tb_holders[type(r).__qualname__] += 1
    del tbs, excs
    lines = [f"memprobe live exceptions: {sum(where.values())}"]
    lines += [f"memprobe traceback chain {w}: {n}" for w, n in heads.most_common(top)]
    lines += [f"memprobe traceback chains held by {h}: {n}" for h, n in tb_holders.most_common(top)]
    if longest:   # a long chain: one exception raised again and again; through which frames
        lines.append(f"memprobe longest traceback chain: {len(longest)} entries in "
                     f"{len({id(t.tb_frame) for t in longest})} frames, of which " + ", ".join(
            f"{n} x {w}" for w, n in Counter(_frame(t) for t in longest).most_common(top)))
        outer = longest[0].tb_frame.f_back
        lines.append("memprobe longest chain's locals: " + ", ".join(
            f"{k}={type(v).__qualname__}" for k, v in list(longest[0].tb_frame.f_locals.items())[:8])
            + f"; called from {outer.f_code.co_name if outer else None}")
    lines += [f"memprobe live exception {w}: {n}" for w, n in where.most_common(top)]
    lines += [f"memprobe live exceptions held by {h}: {n}" for h, n in holders.most_common(top)]
    return lines


def _raised(exc: BaseException) -> str:
    first = tb = exc.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    return f"{type(exc).__name__} raised at {_frame(tb)}, caught in {_frame(first)}"


def _frame(tb) -> str:
    code = tb.tb_frame.f_code
    return f"{_short(code.co_filename)}:{tb.tb_lineno} ({code.co_name})"


def _where(trace: tracemalloc.Traceback) -> str:
    return " <- ".join(f"{_short(f.filename)}:{f.lineno}" for f in trace)


def _short(filename: str) -> str:
    for marker in ("site-packages/", "sdcp_fast/", "lib/python"):
        i = filename.find(marker)
        if i >= 0:
            return filename[i + (len(marker) if marker == "site-packages/" else 0):]
    return filename


def _stat(s: tracemalloc.Statistic) -> str:
    return f"{s.size / 1024:.0f} KiB in {s.count} blocks at {_where(s.traceback)}"


def _diff(s: tracemalloc.StatisticDiff) -> str:
    return (f"{s.size_diff / 1024:+.0f} KiB ({s.count_diff:+d} blocks; now {s.size / 1024:.0f} KiB) "
            f"at {_where(s.traceback)}")
