"""The cores of this host, shared by the deployment's processes one compute call at a time.

    share = CoreShare.for_host()          # every process of the host opens the same set
    with share.take(wait=True) as threads:   # in the thread that runs the call
        model.forward(...)                   # torch runs it on `threads` threads

Why: a verifier and its drafters on one host take turns far more often than they run at
once (a drafter waits for its verdict while the verifier scores its proposal; the verifier
waits for proposals while drafters draft). A thread count fixed per process either leaves
cores idle during each turn (one thread each: the verifier's pass on one core while the
other waits) or oversubscribes them whenever two calls do overlap (every process on all
cores: OpenMP teams of two processes preempting each other at every barrier). So threads
are chosen per call: a call takes the cores no other call holds at that moment and runs
with that many threads, and gives them back when it returns. On a host of its own (a
verifier whose drafters run elsewhere) every call gets every core.

How: one lock file per core in a directory every process of the host uses (tmpfs),
taken with `flock`, which the kernel releases when a process dies, so a crashed holder
never keeps a core. `take(wait=False)` never blocks: with every core held it runs the call
on one thread anyway (an overlap of one thread at most per process). `take(wait=True)`
blocks until at least one core is free; only worker threads should wait, never an event
loop. The thread count applies to the calling thread only (torch's intra-op setting is
per thread: `torch.set_num_threads` here sets OpenMP's per-thread team size and ATen's),
so the worker threads of one process may each hold their own share.

Between the parallel regions of one call (an operator each, tens of microseconds apart)
OpenMP's team threads should spin: a team that sleeps after every region (`OMP_WAIT_POLICY=
PASSIVE`) pays a wake-up per region (bench/RESULTS.md, issue 38, measured it). Between
calls (milliseconds apart) they must not: a process that spins on a core another process's
call now holds slows that call, and an unbounded spin (`ACTIVE`) did so in serving. So
`procs.Cluster` starts instances with a bounded spin (`procs.spin_env`: libgomp's GOMP_SPINCOUNT,
which torch's Linux wheels use, and LLVM/Intel OpenMP's KMP_BLOCKTIME), each a fraction of a
millisecond, unless the environment sets a wait policy of its own.

One thread of each process runs the parallel regions: OpenMP (libgomp, in torch's Linux
wheels) keeps a team of threads for every thread that ever ran a region on more than one
thread, and once a process's team threads outnumber its cores, libgomp cuts every team's spin
to a throttled hundred iterations: the teams then sleep and wake between every two regions
of a pass (bench/RESULTS.md, issue 38, measured what that costs). So the compute calls of a process run on its one compute thread (`aio`'s), and a
role's event loop runs torch on one thread for good (`single_threaded_loop`, before its
first torch call), and so do its other worker threads (`single_threaded_worker`).

`SDCP_CORES=N` caps the cores this host shares (default: the cores this process may run
on); `SDCP_CORE_SHARE=0` turns the sharing off (every call runs on the process's torch
threads, as before); `SDCP_CORE_DIR` names the lock directory (default
/dev/shm/sdcp-cores-UID, else the temp directory).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

ENV_SHARE, ENV_CORES, ENV_DIR = "SDCP_CORE_SHARE", "SDCP_CORES", "SDCP_CORE_DIR"


def host_cores() -> int:
    """Cores this process may run on, capped by SDCP_CORES."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        cores = os.cpu_count() or 1
    cap = os.environ.get(ENV_CORES)
    return max(1, min(cores, int(cap))) if cap else max(1, cores)


def default_directory() -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"sdcp-cores-{os.getuid()}"


class CoreShare:
    """The host's cores as `cores` lock files in `directory` (created if missing)."""

    def __init__(self, directory: str | Path, cores: int):
        if cores < 1:
            raise ValueError("cores must be at least 1")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.cores = cores
        # one descriptor per core and thread: flock locks belong to the open file, so two
        # threads of one process holding "the same" core through one descriptor would both
        # think they hold it
        self._local = threading.local()

    @classmethod
    def for_host(cls) -> CoreShare | None:
        """The host's share as the environment configures it; None when sharing is off."""
        if os.environ.get(ENV_SHARE, "1") == "0":
            return None
        directory = os.environ.get(ENV_DIR) or default_directory()
        return cls(directory, host_cores())

    def _files(self) -> list[int]:
        files = getattr(self._local, "files", None)
        if files is None:
            files = self._local.files = [
                os.open(self.directory / f"core-{n}", os.O_RDWR | os.O_CREAT, 0o600)
                for n in range(self.cores)]
        return files

    def _try(self, fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def acquire(self, *, wait: bool) -> list[int]:
        """Lock every core that is free now (starting at a random one, so processes spread
        out); with none free, wait for one (`wait`) or hold none."""
        files = self._files()
        start = random.randrange(self.cores)
        held = [fd for fd in (files[(start + n) % self.cores] for n in range(self.cores)) if self._try(fd)]
        if not held and wait:
            fd = files[start]
            fcntl.flock(fd, fcntl.LOCK_EX)
            held = [fd]
            held += [f for f in files if f != fd and self._try(f)]
        return held

    @staticmethod
    def release(held: list[int]) -> None:
        for fd in held:
            fcntl.flock(fd, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def take(self, *, wait: bool) -> Iterator[int]:
        """Hold the free cores for a call; yields the thread count it should use (at least
        1) after setting it as this thread's torch thread count."""
        held = self.acquire(wait=wait)
        threads = max(1, len(held))
        torch.set_num_threads(threads)
        try:
            yield threads
        finally:
            self.release(held)


_SHARE: CoreShare | None = None
_SHARE_MADE = False
_LOCK = threading.Lock()


def host_share() -> CoreShare | None:
    """The process's one `CoreShare.for_host()` (None when sharing is off)."""
    global _SHARE, _SHARE_MADE
    with _LOCK:
        if not _SHARE_MADE:
            _SHARE, _SHARE_MADE = CoreShare.for_host(), True
        return _SHARE


_PROCESS_THREADS: int | None = None   # torch's thread count before the loop thread was pinned


def single_threaded_loop() -> None:
    """Run torch on one thread, for good, in the calling thread (a role's event loop), so that
    it never keeps an OpenMP team of its own; the compute thread keeps the process's count
    (`compute_thread_started`). Call it before the thread's first torch call: torch sets a
    thread's count from the process-wide one at that call, which would undo the pin."""
    global _PROCESS_THREADS
    _PROCESS_THREADS = torch.get_num_threads()   # the thread's first torch call: set up now
    torch.set_num_threads(1)


def single_threaded_worker() -> None:
    """The set-up of a role's other worker threads (its event loop's default executor: store
    reads, file writes): torch on one thread there, for good. They are not meant to run torch,
    but some do (a cache read copies its bytes into a tensor); with torch's default count such
    a copy starts an OpenMP team of its own, and one team beside the compute thread's is enough
    for libgomp to throttle the spin of both for the rest of the process (the compute thread's
    passes then sleep and wake between their parallel regions: bench/RESULTS.md, issue 38)."""
    torch.set_num_threads(1)


def compute_thread_started() -> None:
    """The compute thread's set-up: the process's thread count, as it was before the loop
    thread's pin lowered torch's process-wide count to one."""
    count = torch.get_num_threads()   # the thread's first torch call: set up now
    if _PROCESS_THREADS is not None and count != _PROCESS_THREADS:
        torch.set_num_threads(_PROCESS_THREADS)


@contextlib.contextmanager
def compute_threads(*, wait: bool) -> Iterator[int | None]:
    """The cores for one compute call through the host's share; yields the thread count,
    or None when sharing is off (the process's own torch threads apply)."""
    share = host_share()
    if share is None:
        yield None
        return
    with share.take(wait=wait) as threads:
        yield threads
