"""The opt-in memory probe (SDCP_TRACEMALLOC=N): a baseline, then growth by site and type."""

from __future__ import annotations

import tracemalloc

from sdcp_fast.memprobe import MemoryProbe


class Grows:
    pass


def test_probe_reports_what_grew_since_its_baseline(monkeypatch, tmp_path):
    monkeypatch.setenv("SDCP_TRACEMALLOC", "30")
    monkeypatch.setenv("SDCP_TRACEMALLOC_DIR", str(tmp_path))
    probe = MemoryProbe.from_env("verifier")
    assert probe is not None and probe.interval_s == 30
    tracemalloc.start()
    try:
        first = probe.report("test")
        kept = [Grows() for _ in range(5000)]
        later = probe.report("test")
    finally:
        tracemalloc.stop()
    assert first[0].startswith("memprobe t=") and "rss" in first[0] and "malloc" in first[0]
    assert any(line.startswith("memprobe since the baseline") for line in later)
    assert any("test_memprobe.py" in line for line in later if line.startswith("memprobe grew"))
    assert any(line.startswith("memprobe type Grows: +5000") for line in later)
    assert len(list(tmp_path.glob("verifier-*.tracemalloc"))) == 2 and kept
    monkeypatch.delenv("SDCP_TRACEMALLOC")
    assert MemoryProbe.from_env() is None


def test_cyclic_garbage_says_where_its_exceptions_were_raised_and_caught():
    import gc

    def keeps_its_error():
        try:
            raise ValueError("x")
        except ValueError as exc:
            error = exc              # the frame holds the exception, its traceback the frame
        return error is None

    from sdcp_fast.memprobe import cyclic_garbage
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            keeps_its_error()
        lines = cyclic_garbage()
    finally:
        gc.enable()
    assert any(line.startswith("memprobe garbage type traceback: 3") for line in lines)
    assert any("ValueError raised at" in line and "(keeps_its_error)" in line and line.endswith(": 3")
               for line in lines)


def test_live_exceptions_say_where_they_were_raised_and_what_holds_them():
    from sdcp_fast.memprobe import live_exceptions

    class Keeper:
        def __init__(self):
            self.errors = {}

    keeper = Keeper()

    def fails(n):
        try:
            raise LookupError(n)
        except LookupError as exc:
            keeper.errors[n] = exc

    for n in range(4):
        fails(n)
    lines = live_exceptions()
    assert any("LookupError raised at" in line and "(fails)" in line and line.endswith(": 4") for line in lines)
    assert "memprobe live exceptions held by dict: 4" in lines
    assert any(line.startswith("memprobe traceback chains held by LookupError: 4") for line in lines)


def test_light_probe_reports_allocators_without_tracemalloc(monkeypatch):
    monkeypatch.setenv("SDCP_TRACEMALLOC", "20")
    monkeypatch.setenv("SDCP_TRACEMALLOC_LIGHT", "1")
    probe = MemoryProbe.from_env("router")
    probe.start()
    assert not tracemalloc.is_tracing()
    (line,) = probe.report("test")
    for part in ("rss", "malloc in use", "pymalloc", "arenas", "blocks allocated", "threads"):
        assert part in line, line
    assert "pymalloc n/a" not in line and "arenas n/a" not in line and "threads' arenas" in line
    monkeypatch.setenv("SDCP_TRACEMALLOC_ROLES", "verifier,drafter")
    assert MemoryProbe.from_env("router") is None
    assert MemoryProbe.from_env("drafter") is not None
