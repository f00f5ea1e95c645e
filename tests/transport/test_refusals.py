"""Every refusal counted; each (client, kind) logged at most once a minute, however many."""

from __future__ import annotations

import logging

from sdcp_fast.transport import Limits, Refusals


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_flood_of_refusals_is_one_line_per_client_and_minute(caplog):
    caplog.set_level(logging.INFO, logger="sdcp_fast.transport")
    clock, counted = Clock(), []
    refusals = Refusals(on_count=counted.append, clock=clock)
    for n in range(1000):
        refusals.refuse("rapid_reset", "https://attacker.example/", f"attempt {n}")
        clock.now += 0.01                                    # 10 s in all
    refusals.refuse("rapid_reset", "https://other.example/", "once")
    refusals.refuse("malformed", "https://attacker.example/", "another kind")
    clock.now += 60
    refusals.refuse("rapid_reset", "https://attacker.example/", "a minute later")
    lines = [r.getMessage() for r in caplog.records if r.name == "sdcp_fast.transport"]
    assert lines == [
        "refused rapid_reset from https://attacker.example/: attempt 0",
        "refused rapid_reset from https://other.example/: once",
        "refused malformed from https://attacker.example/: another kind",
        "refused rapid_reset from https://attacker.example/: a minute later (and 999 more since the last line)",
    ]
    assert refusals.counts == {"rapid_reset": 1002, "malformed": 1}
    assert len(counted) == 1003


def test_the_log_table_is_bounded():
    refusals = Refusals(max_keys=10)
    for n in range(100):
        refusals.refuse("tls", (f"10.0.{n // 256}.{n % 256}", 40000 + n), "no certificate")
    assert len(refusals._logged) == 10 and refusals.counts["tls"] == 100


def test_limits_merge_body_limits_and_refuse_nonsense():
    limits = Limits(body_limits={"proposals": 100})
    assert limits.body_limit("proposals") == 100
    assert limits.body_limit("drafter") == 64 << 10       # the other defaults stay
    assert limits.body_limit("sessions") == limits.max_body
    for bad in (dict(idle_timeout=0), dict(max_connections=0), dict(max_body=-1)):
        try:
            Limits(**bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} accepted")
