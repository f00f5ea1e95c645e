"""The verifier killed at the two instants group commit must not weaken (issue 18), as real
processes: right after a batch's commit records are durable and before any verdict leaves,
and right after a verdict left and before the next round's append. Either way the router
fences the log, resumes the session at the other verifier from it, and the client's output
is the target's greedy decoding (rule 1) token for token, streamed without a gap or a repeat
(`FrontDoorClient.generate` asserts the indices), and the log alone rebuilds it.

The kill comes from inside the verifier process at the exact point: a `sitecustomize` put on
the verifiers' PYTHONPATH wraps `Engine._append_all` (the one place a batch's records are
appended) and SIGKILLs its own process once, on the first verifier to get there.
"""

from __future__ import annotations

import asyncio
import os
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest
from roles_support import FrontDoorClient, build_cluster, greedy
from test_failover import read_log

from sdcp_fast.cache import effective_commits
from sdcp_fast.core.messages import CommitRecord

pytestmark = pytest.mark.timeout(120)

CRASH_HOOK = textwrap.dedent('''
    import os, signal, sys

    def _install():
        point, after, marker = os.environ["SDCP_TEST_CRASH"].split(":", 2)
        after = int(after)
        from sdcp_fast.verifier import engine

        original = engine.Engine._append_all
        seen = [0]

        def die_once():
            try:   # one verifier only: the first to get there
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return
            os.kill(os.getpid(), signal.SIGKILL)

        async def _append_all(self, records):
            seen[0] += len(records)
            if point == "before-append" and seen[0] > after:
                die_once()       # the verdict of the previous round has left; this one's record not
            answers = await original(self, records)
            if point == "after-append" and seen[0] > after:
                die_once()       # the records are durable; no verdict has left
            return answers

        engine.Engine._append_all = _append_all

    if "serve" in sys.argv and "verifier" in sys.argv and os.environ.get("SDCP_TEST_CRASH"):
        _install()
''')


@pytest.mark.parametrize("point", ["after-append", "before-append"])
def test_verifier_killed_around_an_append_resumes_identically(tmp_path, monkeypatch, point):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(CRASH_HOOK)
    marker = tmp_path / "crashed"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("SDCP_TEST_CRASH", f"{point}:20:{marker}")
    cluster, target = build_cluster(tmp_path, verifiers=2, drafters=1, contract={"max_new": 160})
    prompt = [1, 2, 3]
    cluster.start(timeout=60)
    fd = FrontDoorClient(cluster.instances["router"].frontdoor_url)
    try:
        fd.wait_live(len(cluster.instances) - 1)
        with ThreadPoolExecutor(1) as pool:
            result = pool.submit(fd.generate, prompt, max_new=160).result(timeout=100)
        assert marker.exists(), "no verifier reached the crash point"
        dead = [i for i in cluster.instances.values() if i.role == "verifier" and not i.alive()]
        assert len(dead) == 1
        assert result["end"]["finish"] == "finish"
        assert result["tokens"] == greedy(target, prompt, 160)      # nothing lost, nothing twice
        info = fd.info(result["id"])
        assert info["epoch"] == 2 and info["verifier"] != dead[0].uri
        entries = asyncio.run(read_log(cluster, result["id"]))
        commits = effective_commits(entries)
        assert [t for e in commits for t in CommitRecord.from_cbor(e.record).emitted] == result["tokens"]
        fence = next(e for e in entries if e.kind == "fence")
        assert [e.epoch for e in commits if e.position < fence.position] == [1] * sum(
            e.position < fence.position for e in commits)
    finally:
        fd.close()
        cluster.stop()
