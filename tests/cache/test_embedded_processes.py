"""The embedded backends across processes: shared objects, racing appends, kill -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from asyncio import run
from pathlib import Path

import torch
from cache_workers import q_rows

from sdcp_fast.cache import LogEntry, open_log
from sdcp_fast.cache.file_log import FileCommitLog
from sdcp_fast.cache.qrows import load_q_rows

WORKERS = Path(__file__).with_name("cache_workers.py")


def start_worker(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(WORKERS), *args], stdout=subprocess.PIPE,
                            text=True)


def test_qrows_written_by_one_process_are_read_by_another(shm_dir):
    n, m, vocab, seed = 4, 3, 257, 7
    writer = start_worker("put-qrows", f"embedded:{shm_dir}", "mlc:/q", str(n), str(m),
                          str(vocab), str(seed))
    out, _ = writer.communicate(timeout=120)
    assert writer.returncode == 0 and out.strip() == "done"

    async def verifier():
        from sdcp_fast.cache import open_store

        store = await open_store(f"embedded:{shm_dir}")
        try:
            refs = [(f"mlc:/q/{i}", m) for i in (2, 0, 3)]
            return await load_q_rows(store, refs, vocab, "cpu")
        finally:
            await store.close()

    rows = run(verifier())
    expected = torch.cat([q_rows(seed, i, m, vocab) for i in (2, 0, 3)])
    assert rows.dtype == torch.float32 and rows.shape == (3 * m, vocab)
    assert torch.equal(rows, expected)


def test_processes_filling_one_store_respect_its_cap(shm_dir):
    cap, size, count = 64 * 1024, 4096, 60  # 2 x 60 x 4 KiB offered, 16 objects fit
    spec = f"embedded:{shm_dir}?cap_bytes={cap}"
    leased = b"lease" * 1000

    async def put_leased():
        from sdcp_fast.cache import open_store

        store = await open_store(spec)
        await store.put("mlc:/leased", leased, lease_ms=120_000)
        await store.close()

    run(put_leased())
    fillers = [start_worker("fill", spec, name, str(count), str(size)) for name in ("a", "b")]
    for filler in fillers:
        out, _ = filler.communicate(timeout=120)
        assert filler.returncode == 0 and out.strip() == "done"

    async def check():
        from sdcp_fast.cache import NotFound, open_store

        store = await open_store(spec)
        try:
            assert await store.get("mlc:/leased") == leased
            survivors = 0
            for name in "ab":
                for i in range(count):
                    try:
                        data = await store.get(f"mlc:/fill/{name}/{i}")
                    except NotFound:
                        continue
                    assert data == (name.encode() + bytes([i % 256])) * (size // 2)
                    survivors += 1
            files = sum(p.stat().st_size for p in (shm_dir / "objects").iterdir())
            return survivors, files
        finally:
            await store.close()

    survivors, stored_bytes = run(check())
    assert survivors == (cap - len(leased)) // size  # LRU filled exactly what fits
    assert stored_bytes == survivors * size + len(leased) <= cap


def test_racing_processes_each_position_won_once(tmp_path):
    directory, log_name, wins = str(tmp_path / "log"), "mlc:/race", 15
    workers = [start_worker("race-append", directory, log_name, name, str(wins))
               for name in ("A", "B", "C")]
    won = {}
    for name, worker in zip("ABC", workers, strict=True):
        out, _ = worker.communicate(timeout=120)
        assert worker.returncode == 0
        won[name] = [int(line) for line in out.split()]
    entries = run(FileCommitLog(directory).read(log_name))
    assert len(entries) == 3 * wins
    assert sorted(p for positions in won.values() for p in positions) == list(range(3 * wins))
    for name, positions in won.items():
        for k, position in enumerate(positions):
            assert entries[position].record == f"{name}-{k}".encode()


def test_kill_9_loses_no_acknowledged_record(tmp_path):
    directory, log_name = str(tmp_path / "log"), "mlc:/crash"
    writer = start_worker("append-forever", directory, log_name)
    acknowledged = []
    while len(acknowledged) < 40:
        line = writer.stdout.readline()
        assert line, "writer died early"
        acknowledged.append(int(line))
    os.kill(writer.pid, signal.SIGKILL)
    # read the rest through the same buffered file: communicate(timeout=...) reads the raw
    # descriptor and would miss lines already in this file's buffer
    rest = writer.stdout.read()
    writer.wait(timeout=30)
    acknowledged += [int(line) for line in rest.split()]  # printed before the kill landed
    assert writer.returncode == -signal.SIGKILL
    assert acknowledged == list(range(len(acknowledged)))

    async def reopen():
        log = await open_log(f"file:{directory}")
        entries = await log.read(log_name)
        # The log may hold one record more than was printed (fsynced, then killed).
        assert len(entries) in (len(acknowledged), len(acknowledged) + 1)
        for position in acknowledged:
            assert entries[position] == LogEntry(position, "commit", 1, b"rec-%d" % position)
        assert await log.append(log_name, b"after", epoch=1, expected=len(entries)) == \
            len(entries) + 1

    run(reopen())


def test_torn_tail_is_ignored_and_truncated_by_the_next_append(tmp_path):
    async def body():
        log = FileCommitLog(tmp_path / "log")
        for i in range(3):
            await log.append("mlc:/t", b"r%d" % i, epoch=1, expected=i)
        path = log.path_of("mlc:/t")
        intact = path.read_bytes()
        frame = len(intact) // 3  # three frames of equal size (same record length)
        bad_checksum = bytearray(intact[:frame])
        bad_checksum[-1] ^= 0xFF
        torn_tails = [intact[:5],  # part of a header
                      intact[:frame - 4],  # header and part of the payload
                      bytes(bad_checksum)]  # a whole frame whose checksum does not match
        for torn in torn_tails:
            path.write_bytes(intact + torn)
            fresh = FileCommitLog(tmp_path / "log")  # a new process's view
            assert [e.record for e in await fresh.read("mlc:/t")] == [b"r0", b"r1", b"r2"]
        assert await fresh.append("mlc:/t", b"r3", epoch=1, expected=3) == 4
        assert path.stat().st_size == 4 * frame  # the torn tail was cut before appending
        assert [e.record for e in await fresh.read("mlc:/t")] == [b"r0", b"r1", b"r2", b"r3"]

    run(body())


def test_leftovers_of_crashed_writers_are_removed_on_open(shm_dir):
    async def body():
        from sdcp_fast.cache.embedded_store import EmbeddedStore

        store = EmbeddedStore(shm_dir)
        await store.put("mlc:/kept", b"kept")
        await store.close()
        objects = shm_dir / "objects"
        (objects / ".tmp-999999999-dead").write_bytes(b"half")  # temp file of a dead pid
        (objects / f".tmp-{os.getpid()}-live").write_bytes(b"busy")  # a live writer's
        (objects / "renamed-but-never-indexed").write_bytes(b"orphan")
        store = EmbeddedStore(shm_dir)
        try:
            names = sorted(p.name for p in objects.iterdir())
            assert len(names) == 2 and names[0] == f".tmp-{os.getpid()}-live"
            assert await store.get("mlc:/kept") == b"kept"
        finally:
            await store.close()

    run(body())
