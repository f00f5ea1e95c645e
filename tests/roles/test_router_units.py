"""Router placement policy, config files and the process launcher's TOML, without processes."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest

from sdcp_fast import config as schema
from sdcp_fast.config import ConfigError, ContractSection, load
from sdcp_fast.core.messages import ROLE_DRAFTER, ROLE_VERIFIER, Action, Status
from sdcp_fast.procs import Cluster
from sdcp_fast.router.registry import Registry
from sdcp_fast.serve import contract_defaults

D1, D2, D3, V1, V2 = (f"https://{n}.test/" for n in ("d1", "d2", "d3", "v1", "v2"))
MODEL_A, MODEL_B = b"a" * 32, b"b" * 32


def registry() -> Registry:
    r = Registry(session_load=5)
    r.add(V1, ROLE_VERIFIER)
    r.add(V2, ROLE_VERIFIER)
    r.add(D1, ROLE_DRAFTER, MODEL_A)
    r.add(D2, ROLE_DRAFTER, MODEL_A)
    r.add(D3, ROLE_DRAFTER, MODEL_B)
    return r


def drafter_status(uri, load=0, queue=0, accept=500, ttl=1000):
    return Status(uri, ROLE_DRAFTER, load, queue, ttl, accept_milli=accept)


def test_no_instance_is_chosen_before_its_first_report_or_after_expiry():
    r = registry()
    assert r.pick_drafter(None) is None and r.pick_verifier() is None
    r.report(drafter_status(D1, ttl=1000), now=100.0)
    assert r.is_live(D1, now=100.9) and not r.is_live(D1, now=101.0)
    assert r.live(ROLE_DRAFTER, now=101.5) == []


def test_drafter_choice_prefers_low_load_then_queue_then_acceptance():
    r = registry()
    r.report(drafter_status(D1, load=40))
    r.report(drafter_status(D2, load=10))
    assert r.pick_drafter([MODEL_A]).uri == D2
    r.report(drafter_status(D1, load=10, queue=0, accept=100))
    r.report(drafter_status(D2, load=10, queue=3, accept=900))
    assert r.pick_drafter([MODEL_A]).uri == D1            # queue before acceptance
    r.report(drafter_status(D1, load=10, accept=100))
    r.report(drafter_status(D2, load=10, accept=900))
    assert r.pick_drafter([MODEL_A]).uri == D2            # then acceptance


def test_a_burst_of_sessions_spreads_before_the_next_report():
    r = registry()
    r.report(drafter_status(D1))
    r.report(drafter_status(D2))
    picks = [r.pick_drafter([MODEL_A]).uri for _ in range(6)]
    assert picks.count(D1) == picks.count(D2) == 3


def test_only_permitted_models_and_not_excluded_instances():
    r = registry()
    for d in (D1, D2, D3):
        r.report(drafter_status(d))
    assert r.pick_drafter([MODEL_B]).uri == D3
    assert r.pick_drafter([MODEL_A], exclude={D1, D2}) is None
    assert r.pick_drafter(None, exclude={D1, D2}).uri == D3   # no "drafters": any model


def test_verifier_choice_by_load():
    r = registry()
    r.report(Status(V1, ROLE_VERIFIER, 70, 4, 1000))
    r.report(Status(V2, ROLE_VERIFIER, 20, 0, 1000))
    assert r.pick_verifier().uri == V2
    assert r.pick_verifier(exclude={V2}).uri == V1


def test_idle_verifiers_share_new_sessions_in_turn_though_a_report_came_between():
    """Both report load 0 (no job waiting): a report between two opens clears the count of
    sessions placed since, and the count of all placed there still sends the second
    elsewhere; load comes first."""
    r = registry()
    r.report(Status(V1, ROLE_VERIFIER, 0, 0, 1000))
    r.report(Status(V2, ROLE_VERIFIER, 0, 0, 1000))
    first = r.pick_verifier().uri
    r.report(Status(first, ROLE_VERIFIER, 0, 0, 1000))
    second = r.pick_verifier().uri
    assert {first, second} == {V1, V2}
    picks = []
    for _ in range(4):
        picks.append(r.pick_verifier().uri)
        r.report(Status(V1, ROLE_VERIFIER, 0, 0, 1000))
        r.report(Status(V2, ROLE_VERIFIER, 0, 0, 1000))
    assert picks.count(V1) == picks.count(V2) == 2
    r.report(Status(V1, ROLE_VERIFIER, 30, 2, 1000))
    assert r.pick_verifier().uri == V2 and r.pick_verifier().uri == V2   # load before the count


# ---------------------------------------------------------------------- configs


def test_configs_the_launcher_writes_are_what_serve_reads(tmp_path):
    """procs writes each instance's file from the schema (tomli-w); serve reads it back equal."""
    cluster = Cluster(tmp_path, protocol="h3")
    cluster.verifier("v1", model="table:t", max_batch=8, metrics="127.0.0.1:9300")
    cluster.drafter("d1", model="table:d", draft_ahead=False)
    cluster.router(model="table:t", drafter_models={"d1": "00ff"}, frontdoor_tls=True,
                   contract={"rule": 2, "fallback": ["reduce"], "sampling": {"seed": 7}})
    for instance in cluster.instances.values():
        text = schema.dumps(instance.config)
        assert tomllib.loads(text)["role"] == instance.role
        assert schema.loads(text) == instance.config
    router = schema.loads(schema.dumps(cluster.instances["router"].config)).router
    assert (router.drafters[0].model_digest, router.contract.sampling) == ("00ff", {"seed": 7})
    assert "commit_log" not in tomllib.loads(schema.dumps(cluster.instances["d1"].config))["drafter"]


def test_config_errors_name_the_member(tmp_path):
    base = 'uri = "https://127.0.0.1:1/"\ncerts = "c"\nmodel = "m"\nstore = "s"\n'
    with pytest.raises(ConfigError, match=r"d.toml.drafter.ttl_ms: expected int, got str"):
        schema.loads(base + '[drafter]\nrouters = []\nttl_ms = "soon"\n', "d.toml")
    with pytest.raises(ConfigError, match=r"d.toml: missing 'uri'"):
        schema.loads('certs = "c"\nmodel = "m"\nstore = "s"\n', "d.toml")
    with pytest.raises(ConfigError, match=r"d.toml.drafter.draft_ahead: expected bool, got int"):
        schema.loads(base + '[drafter]\nrouters = []\ndraft_ahead = 1\n', "d.toml")
    with pytest.raises(ConfigError, match=r"d.toml.drafter: unknown member 'ttl' \(did you mean 'ttl_ms'\?\)"):
        schema.loads(base + '[drafter]\nrouters = []\nttl = 5\n', "d.toml")
    with pytest.raises(ConfigError, match=r"r.toml.router.contract.fallback: unknown actions \['retry'\]"):
        schema.loads(base + '[router]\nverifiers = []\ndrafters = []\n[router.contract]\n'
                     'fallback = ["reduce", "retry"]\n', "r.toml")
    with pytest.raises(ConfigError, match=r"protocol: 'h2' or 'h3'"):
        schema.loads(base + 'protocol = "h4"\n')
    bad = tmp_path / "bad.toml"
    bad.write_text("uri = [")
    with pytest.raises(ConfigError, match="bad.toml"):
        load(bad)


def test_contract_defaults_from_a_config():
    d = contract_defaults(ContractSection(rule=2, m_max=5, fallback=["switch", "fail"], stop=[10],
                                          sampling={"temperature_milli": 800, "seed": 3}))
    assert (d.rule, d.m_max, d.stop, d.fallback) == (2, 5, (10,), (Action.SWITCH, Action.FAIL))
    assert (d.sampling.temperature_milli, d.sampling.seed) == (800, 3)


def test_serve_refuses_a_bad_config_with_exit_code_2(tmp_path):
    config = tmp_path / "v.toml"
    config.write_text('role = "drafter"\nuri = "https://127.0.0.1:9/"\n')
    done = subprocess.run([sys.executable, "-m", "sdcp_fast.cli", "serve", "verifier", "--config", str(config)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "v.toml is a drafter config, not a verifier one" in done.stderr


def test_front_door_over_tls_asks_for_a_client_certificate(tmp_path):
    """frontdoor_tls = true: TLS 1.3 with a client certificate from the deployment's CA."""
    import asyncio
    import ssl

    import httpx

    from sdcp_fast.router import FrontDoor
    from sdcp_fast.transport import TLSConfig, make_certs
    from sdcp_fast.transport.asgi import serve_web

    router_uri, client_uri = "https://127.0.0.1:1/", "https://client.test/"
    make_certs(tmp_path, [router_uri, client_uri])

    class FakeRouter:
        registry = registry()

    def client_context(with_cert: bool) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        if with_cert:
            tls = TLSConfig.for_instance(tmp_path, client_uri)
            context.load_cert_chain(tls.cert, tls.key)
        return context

    async def main():
        door = await serve_web(FrontDoor(FakeRouter()), host="127.0.0.1", port=0,
                               tls=TLSConfig.for_instance(tmp_path, router_uri))
        port = door.port
        try:
            async with httpx.AsyncClient(verify=client_context(True)) as http:
                answer = await http.get(f"https://127.0.0.1:{port}/v1/instances", timeout=10)
            assert answer.status_code == 200
            assert {i["uri"] for i in answer.json()["instances"]} == {D1, D2, D3, V1, V2}
            with pytest.raises(httpx.HTTPError):
                async with httpx.AsyncClient(verify=client_context(False)) as http:
                    await http.get(f"https://127.0.0.1:{port}/v1/instances", timeout=10)
        finally:
            await door.stop()

    asyncio.run(asyncio.wait_for(main(), 30))


# ---------------------------------------------------------------------- front door input


BAD_GENERATE = [
    ({"tokens": [1], "stop": 5}, 400),               # stop is not a list
    ({"tokens": [1], "stop": [1.5]}, 400),
    ({"tokens": [1], "stop": [True]}, 400),
    ({"tokens": [1], "stop": ["3"]}, 400),
    ({"tokens": [1], "max_new": 1.5}, 400),          # not silently truncated to 1
    ({"tokens": [1], "max_new": True}, 400),         # JSON true is not 1
    ({"tokens": [1], "m_max": "4"}, 400),
    ({"tokens": [1], "rule": None}, 400),
    ({"tokens": [True, 2]}, 400),
    ({"tokens": [1], "sampling": 5}, 400),
    ({"tokens": [1], "sampling": {"temperature_milli": "hot"}}, 422),
    ({"tokens": [1], "m_max": 0}, 422),              # contract checks: sdcp-bad-contract
    ({"tokens": [1], "rule": 9}, 422),
    ({"tokens": []}, 400),                           # empty prompt
]


@pytest.mark.parametrize(("body", "status"), BAD_GENERATE, ids=[str(b) for b, _ in BAD_GENERATE])
def test_front_door_refuses_bad_generate_requests_as_client_errors(tmp_path, body, status):
    """Malformed members get 400 (422 for a contract the protocol refuses), never 500."""
    import asyncio

    import httpx
    from roles_support import make_tables

    from sdcp_fast.models import load_backend
    from sdcp_fast.router import FrontDoor, RouterConfig, RouterService
    from sdcp_fast.transport.asgi import serve_web

    target, _ = make_tables(tmp_path)
    router = RouterService(RouterConfig("https://router.test/", (V1,), ((D1, MODEL_A),)),
                           load_backend(target), None, None, client=None)

    async def main():
        door = await serve_web(FrontDoor(router), host="127.0.0.1", port=0)
        port = door.port
        try:
            async with httpx.AsyncClient() as http:
                return await http.post(f"http://127.0.0.1:{port}/v1/generate", json=body, timeout=10)
        finally:
            await door.stop()

    answer = asyncio.run(asyncio.wait_for(main(), 30))
    assert answer.status_code == status, answer.text
    assert "error" in answer.json()
    assert router.sessions == {}                     # nothing was started


# ---------------------------------------------------------------------- child processes


def test_child_of_a_parent_that_is_gone_terminates_itself():
    """The preexec hook checks, after prctl, that the parent is still the one that forked
    the child: one that died in between would never send PDEATHSIG."""
    import signal

    from sdcp_fast.procs import die_with_parent

    not_our_parent = subprocess.Popen([sys.executable, "-c", "pass"])
    not_our_parent.wait(30)
    child = subprocess.Popen(["sleep", "30"], preexec_fn=die_with_parent(not_our_parent.pid))
    assert child.wait(30) == -signal.SIGTERM


def test_child_is_terminated_when_its_parent_dies(tmp_path):
    """PR_SET_PDEATHSIG: a launcher that dies (SIGKILL, no cleanup) takes its child along."""
    import time

    pid_file = tmp_path / "child.pid"
    launcher = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "from sdcp_fast.procs import die_with_parent\n"
        "child = subprocess.Popen(['sleep', '60'], preexec_fn=die_with_parent())\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n")])
    deadline = time.monotonic() + 30
    while not pid_file.is_file() or not pid_file.read_text():
        assert time.monotonic() < deadline, "launcher did not start its child"
        time.sleep(0.05)
    child = int(pid_file.read_text())
    launcher.kill()
    launcher.wait(10)
    deadline = time.monotonic() + 10
    while _running(child):
        assert time.monotonic() < deadline, "child outlived its parent"
        time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_busy_answers_of_the_front_door_say_when_to_ask_again():
    """A 503 (no verifier could open the session, the router at max_sessions) carries
    Retry-After, at the front door and in the OpenAI API; a 400 does not."""
    import asyncio
    from types import SimpleNamespace

    from sdcp_fast.core.problems import Kind, problem
    from sdcp_fast.router.frontdoor import FrontDoor
    from sdcp_fast.router.openai_api import APIError
    from sdcp_fast.transport.asgi import WebRequest

    class BusyRouter:
        backend = SimpleNamespace(vocab_size=8)

        def make_contract(self, **overrides):
            return None

        async def generate(self, *args, **kwargs):
            raise problem(Kind.UNAVAILABLE, "no verifier could open the session")

    door = FrontDoor(BusyRouter())
    busy = asyncio.run(door.handle(WebRequest("POST", "/v1/generate", {}, {}, b'{"tokens": [1]}')))
    assert busy.status == 503 and ("retry-after", "1") in busy.headers
    assert b"no verifier could open" in busy.body
    bad = asyncio.run(door.handle(WebRequest("POST", "/v1/generate", {}, {}, b"{}")))
    assert bad.status == 400 and bad.headers == ()
    assert ("retry-after", "1") in APIError(503, "busy").response().headers
    assert APIError(400, "bad").response().headers == ()


def test_ended_sessions_kept_for_re_reads_are_bounded_by_count_and_by_time():
    """Bounded memory (issue 21's soak): a router keeps an ended session closed_keep_s for
    re-reads, and never more than closed_keep_max of them whatever the rate of generations
    (the oldest go first); live sessions are never let go."""
    from sdcp_fast.core.messages import Contract
    from sdcp_fast.router.sessions import RouterSession, expired

    contract = Contract(target=MODEL_A, tokenizer=MODEL_B, rule=1, m_max=4, max_new=8, stop=(),
                        low_rounds=2, fallback=(Action.REDUCE,))
    kept: dict[bytes, RouterSession] = {}
    live = []
    for n in range(2000):            # one generation ended every 0.01 s: 20 s of a busy router
        s = RouterSession(n.to_bytes(16, "big"), contract, (1, 2), f"log-{n}")
        kept[s.id] = s
        if n % 100 == 0:
            live.append(s)           # still running
        else:
            s.end(finish=Action.FINISH)
            s.finished_at = n * 0.01
        for old in expired(kept, n * 0.01, keep_s=5.0, keep_max=64):
            del kept[old.id]
        assert sum(1 for s in kept.values() if s.done) <= 64
    assert all(s.id in kept for s in live)
    ended = sorted((s for s in kept.values() if s.done), key=lambda s: s.finished_at)
    assert [int.from_bytes(s.id, "big") for s in ended] == [n for n in range(1999 - 65, 2000) if n % 100][-64:]
    # by time alone when few: only those ended over keep_s ago
    few = {s.id: s for s in ended[:3]}
    assert expired(few, ended[0].finished_at + 5.0, keep_s=5.0, keep_max=64) == []
    assert expired(few, ended[1].finished_at + 5.001, keep_s=5.0, keep_max=64) == ended[:2]


def test_a_session_remembers_its_last_placements_only():
    """A long session that stalls or fails over again and again keeps a bounded history."""
    from sdcp_fast.core.messages import Contract
    from sdcp_fast.router.sessions import HISTORY_KEPT, RouterSession

    contract = Contract(target=MODEL_A, tokenizer=MODEL_B, rule=1, m_max=4, max_new=8, stop=(),
                        low_rounds=2, fallback=(Action.REDUCE,))
    s = RouterSession(b"s" * 16, contract, (1,), "log")
    for n in range(5 * HISTORY_KEPT):
        s.place("stalled", n=n)
    assert [h["n"] for h in s.info()["history"]] == list(range(4 * HISTORY_KEPT, 5 * HISTORY_KEPT))


def test_an_open_under_way_is_given_up_once_its_verifier_goes_silent():
    """The verifier picked for a session-open is cut off (its open never answers): once its
    status expires the open is given up and the next verifier by load opens the session,
    long before the open's own timeout."""
    import asyncio
    import time

    from sdcp_fast.core.messages import Contract, SessionState
    from sdcp_fast.router import placement
    from sdcp_fast.router.sessions import RouterSession

    reg = registry()
    reg.report(Status(V1, ROLE_VERIFIER, 10, 0, 300))    # picked first (less load), ttl 0.3 s
    reg.report(Status(V2, ROLE_VERIFIER, 50, 0, 60_000))

    class Peers:
        opened_at: dict[str, float] = {}

        async def open_session(self, verifier, msg):
            self.opened_at[verifier] = time.monotonic()
            if verifier == V1:
                await asyncio.sleep(3600)   # cut off: no answer
            return SessionState(msg.session, msg.epoch, 0, 0, b"\0" * 32)

    class Own:
        async def act(self, s):
            pass

    contract = Contract(target=MODEL_A, tokenizer=MODEL_B, rule=1, m_max=4, max_new=8, stop=(),
                        low_rounds=2, fallback=(Action.REDUCE,))
    s = RouterSession(b"s" * 16, contract, (1,), "log")
    place = placement.Placement(reg, Peers(), None, Own(), m_init=4, on_verifier_lost=None)
    began = time.monotonic()
    assert asyncio.run(asyncio.wait_for(place.open(s, set()), 10))
    assert s.verifier == V2 and list(Peers.opened_at) == [V1, V2]
    assert Peers.opened_at[V2] - began < 0.3 + 2 * placement.SILENCE_POLL_S + 0.5
