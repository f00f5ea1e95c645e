"""The host's cores shared one compute call at a time (sdcp_fast/cores.py): a call takes the
cores no other call holds and runs on that many torch threads; one that finds none runs on
one thread (or, in a worker thread, waits for one); a holder that dies frees its cores."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from sdcp_fast.cores import CoreShare


def test_a_call_takes_the_free_cores_and_sets_its_threads(tmp_path):
    share = CoreShare(tmp_path, 2)
    with share.take(wait=False) as threads:
        assert threads == 2 and torch.get_num_threads() == 2
        seen = {}

        def other():
            with share.take(wait=False) as n:   # every core held: one thread, no wait
                seen["threads"], seen["torch"] = n, torch.get_num_threads()

        t = threading.Thread(target=other)
        t.start()
        t.join(5)
        assert seen == {"threads": 1, "torch": 1}
    with share.take(wait=False) as threads:   # given back
        assert threads == 2


def test_a_worker_waits_for_a_core_and_then_takes_what_is_free(tmp_path):
    share = CoreShare(tmp_path, 2)
    got = {}
    held = threading.Event()
    release = threading.Event()
    releasing = threading.Event()

    def holder():
        with share.take(wait=True):
            held.set()
            release.wait(5)
            releasing.set()   # the cores go back one by one from here

    def waiter():
        held.wait(5)
        with share.take(wait=True) as n:
            got["threads"], got["after_release"] = n, releasing.is_set()

    threads = [threading.Thread(target=holder), threading.Thread(target=waiter)]
    for t in threads:
        t.start()
    held.wait(5)
    time.sleep(0.2)
    assert got == {}   # the waiter is blocked while both cores are held
    release.set()
    for t in threads:
        t.join(5)
    # it ran once the holder let go, on the one core it waited for or both
    assert got["after_release"] and got["threads"] in (1, 2)


def test_a_holder_that_dies_frees_its_cores(tmp_path):
    code = ("import sys, time; from sdcp_fast.cores import CoreShare; "
            "s = CoreShare(sys.argv[1], 2); s.acquire(wait=False); print('held', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        assert CoreShare(tmp_path, 2).acquire(wait=False) == []   # the child holds both
    finally:
        child.kill()
        child.wait(5)
    with CoreShare(tmp_path, 2).take(wait=False) as threads:
        assert threads == 2


def test_every_compute_call_of_a_process_runs_on_its_one_compute_thread():
    """OpenMP keeps a team for each thread that runs a parallel region, and more team threads
    than cores throttle every team's spin (cores.py): so Offload's compute calls and
    `compute()` share one thread, never the event loop's, while other offloads do not."""
    import asyncio

    from sdcp_fast.aio import Offload, compute

    async def main():
        here = threading.get_ident()
        where = threading.get_ident
        seen = [await Offload(compute=True, inline_below_s=0.0).run(where) for _ in range(3)]
        seen += [await compute(where) for _ in range(3)]
        seen.append(await Offload(compute=True, inline_below_s=0.0).run(where))
        plain = await Offload(inline_below_s=0.0).run(threading.current_thread)
        return here, seen, plain

    here, seen, plain = asyncio.run(main())
    assert len(set(seen)) == 1 and seen[0] != here
    assert not plain.name.startswith("sdcp-compute")


PINNED_LOOP = """
import os, threading, torch
from sdcp_fast import aio
from sdcp_fast.cores import single_threaded_loop
torch.set_num_threads(2)   # the process's count, whatever this machine's cores
single_threaded_loop()
tasks = lambda: len(os.listdir("/proc/self/task"))
before = tasks()
x = torch.ones(1 << 22)
float(x.sum()); float((x * 2).sum())   # parallel-sized work on the pinned thread
after_loop = tasks()
pool = aio.compute_executor()
counts = pool.submit(torch.get_num_threads).result()
pool.submit(lambda: float((x * 3).sum())).result()
print(torch.get_num_threads(), counts, after_loop - before, tasks() - after_loop)
"""


def test_the_pinned_loop_thread_keeps_no_team_and_the_compute_thread_the_process_count():
    if not Path("/proc/self/task").is_dir():
        pytest.skip("counts threads in /proc/self/task (Linux)")
    out = subprocess.run([sys.executable, "-c", PINNED_LOOP], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "SDCP_CORE_SHARE": "0"})
    assert out.returncode == 0, out.stderr
    loop_threads, compute_threads_, loop_new, compute_new = map(int, out.stdout.split())
    assert loop_threads == 1 and compute_threads_ == 2
    assert loop_new == 0          # the loop thread's parallel-sized work started no OpenMP thread
    assert compute_new == 2       # the compute thread itself and the one thread of its team


IO_WORKER = """
import os, sys, torch
from concurrent.futures import ThreadPoolExecutor
from sdcp_fast import aio
from sdcp_fast.cores import single_threaded_loop, single_threaded_worker
torch.set_num_threads(2)   # the process's count, whatever this machine's cores
single_threaded_loop()
x = torch.ones(1 << 22)
aio.compute_executor().submit(lambda: float((x * 3).sum())).result()   # the compute thread's team
tasks = lambda: len(os.listdir("/proc/self/task"))
io = ThreadPoolExecutor(1, initializer=single_threaded_worker if sys.argv[1] == "pinned" else None)
io.submit(lambda: None).result()   # the worker thread exists
before = tasks()
count = io.submit(torch.get_num_threads).result()
io.submit(lambda: float((x * 4).sum())).result()   # parallel-sized work in the worker
print(count, tasks() - before)
"""


@pytest.mark.parametrize("pinned", [True, False])
def test_a_roles_io_workers_run_torch_on_one_thread_and_start_no_team(pinned):
    """What `serve` gives a role's event loop as its default executor: a torch call in one of
    its threads starts no OpenMP team beside the compute thread's (and without the pin, one
    does: the case the pin is for)."""
    if not Path("/proc/self/task").is_dir():
        pytest.skip("counts threads in /proc/self/task (Linux)")
    out = subprocess.run([sys.executable, "-c", IO_WORKER, "pinned" if pinned else "default"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "SDCP_CORE_SHARE": "0"})
    assert out.returncode == 0, out.stderr
    count, new_threads = map(int, out.stdout.split())
    if pinned:
        assert (count, new_threads) == (1, 0)
    else:
        assert count == 2 and new_threads == 1
