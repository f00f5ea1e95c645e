"""The host's cores shared one compute call at a time (sdcp_fast/cores.py): a call takes the
cores no other call holds and runs on that many torch threads; one that finds none runs on
one thread (or, in a worker thread, waits for one); a holder that dies frees its cores."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

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
