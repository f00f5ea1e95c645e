"""A deployment across test hosts (issue 36, CI's short version): network namespaces on a
bridge, each host with its own address, one role per host (a router, two verifiers, a
drafter) and a 3-member etcd cluster (commit log and session table), with certificates
naming each host's address.

The fault: the host of the verifier that serves a live generation is cut off (its link down,
`ip link set eth0 down` inside it) while three generations stream, two under rule 1 and one
under rule 2 with a seed; the router fails the sessions over to the other verifier, and the
link comes back up before the generations end. Then every output is exact: rule 1 equal to
the target's greedy decoding, both rules equal to what the session's commit log (on the etcd
cluster) holds, streamed without a gap or a repeat, and every generation finished. The cut
point is drawn from a printed seed (SDCP_FAULT_SEED replays it).

The harness itself: hosts reach each other by address, a cut link carries nothing until
restored, and the namespaces go with the harness however it ends (SIGKILL included).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from cryptography import x509
from hosts_support import recovery_bound, wait_committed_past
from roles_support import FrontDoorClient, greedy, make_tables, wait_until
from test_faults import committed_tokens

from sdcp_fast.hosts.netns import Network, list_namespaces
from sdcp_fast.hosts.testbed import Testbed
from sdcp_fast.models import load_backend
from sdcp_fast.transport.certs import instance_file_name

MAX_NEW = 120
pytestmark = pytest.mark.timeout(240)

ECHO = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 7000)); s.listen(); print("ready", flush=True)
while True:
    c, peer = s.accept(); c.sendall(peer[0].encode()); c.close()
"""


def _ask(address: str, timeout: float = 1.0) -> str:
    with socket.create_connection((address, 7000), timeout=timeout) as sock:
        sock.settimeout(timeout)
        return sock.recv(64).decode()


def test_hosts_have_their_own_addresses_and_links_cut(hosts_available, tmp_path):
    with Network(["a", "b"]) as net:
        assert net.address("a") != net.address("b")
        servers = [subprocess.Popen([*net.wrap(h), sys.executable, "-c", ECHO, net.address(h)],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) for h in ("a", "b")]
        try:
            for s in servers:
                assert s.stdout.readline().strip() == b"ready"
            assert _ask(net.address("a")) == net.client_address     # this process, over the client link
            # host a asks host b: b sees a's own address
            out = subprocess.run([*net.wrap("a"), sys.executable, "-c",
                                  "import socket,sys; s=socket.create_connection((sys.argv[1],7000),2);"
                                  "print(s.recv(64).decode())", net.address("b")],
                                 capture_output=True, text=True, timeout=20)
            assert out.stdout.strip() == net.address("a")
            net.cut("b")
            with pytest.raises(OSError):
                _ask(net.address("b"), timeout=0.5)
            assert _ask(net.address("a")) == net.client_address
            net.restore("b")
            wait_until(lambda: _try(net.address("b")), 10, "b unreachable after the link came back")
        finally:
            for s in servers:
                s.kill()
                s.wait(5)
        names = net.namespaces()
    assert not set(names) & set(list_namespaces())


def _try(address: str) -> bool:
    try:
        return bool(_ask(address, 0.5))
    except OSError:
        return False


def test_namespaces_go_when_the_harness_is_killed(hosts_available):
    code = ("import sys, time; from sdcp_fast.hosts.netns import Network; n = Network(['x', 'y']).up();"
            "print(' '.join(n.namespaces()), flush=True); time.sleep(120)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        names = child.stdout.readline().split()
        assert len(names) == 3 and set(names) <= set(list_namespaces())
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    wait_until(lambda: not set(names) & set(list_namespaces()), 20, f"namespaces left after SIGKILL: {names}")


RELAY_ECHO = """
import socket, sys, threading
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind((sys.argv[1], 8443))
def udp():
    while True:
        d, p = u.recvfrom(65536); u.sendto(p[0].encode() + b" " + d, p)
threading.Thread(target=udp, daemon=True).start()
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 8443)); s.listen(); print("ready", flush=True)
while True:
    c, peer = s.accept(); c.sendall(peer[0].encode() + b" ")
    while (d := c.recv(65536)):
        c.sendall(d)
    c.close()
"""

RELAY_CLIENT = """
import socket, sys
s = socket.create_connection((sys.argv[1], 8443), 5); s.settimeout(10)
data = bytes(range(256)) * 4096
s.sendall(data); s.shutdown(socket.SHUT_WR)
got = b""
while (d := s.recv(65536)):
    got += d
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(5); u.connect((sys.argv[1], 8443))
u.send(b"datagram")
print(got.split(b" ", 1)[0].decode(), got.split(b" ", 1)[1] == data, u.recv(100).decode())
"""


def test_relay_forwards_tcp_and_udp_transparently(hosts_available, tmp_path):
    """A far host reaches a near one through the delay relay: the bytes arrive intact both
    ways, and the near host sees the far host's own address (TCP and UDP)."""
    from sdcp_fast.hosts.relay import RelayProcess

    with Network(["near", "far"], far=["far"], relay=True) as net:
        server = subprocess.Popen([*net.wrap("near"), sys.executable, "-c", RELAY_ECHO, net.address("near")],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        relay = RelayProcess(net, 1.0, tmp_path / "relay.log")
        try:
            assert server.stdout.readline().strip() == b"ready"
            relay.start()
            out = subprocess.run([*net.wrap("far"), sys.executable, "-c", RELAY_CLIENT, net.address("near")],
                                 capture_output=True, text=True, timeout=30)
            far = net.address("far")
            assert out.stdout.split() == [far, "True", far, "datagram"], out.stderr[-800:]
        finally:
            relay.stop()
            server.kill()
            server.wait(5)


@pytest.fixture
def seed():
    value = int(os.environ.get("SDCP_FAULT_SEED", str(random.SystemRandom().randrange(1 << 32))))
    print(f"SDCP_FAULT_SEED={value}")
    return value


def test_verifier_host_cut_off_and_back_outputs_exact(hosts_available, tmp_path, seed):
    rng = random.Random(seed)
    target, draft = make_tables(tmp_path)
    digest = load_backend(draft).digest.hex()
    hosts = ["router", "verifier-1", "verifier-2", "drafter-1"]
    with Testbed(tmp_path / "bed", hosts=hosts) as bed:
        cluster = bed.cluster
        for v in ("verifier-1", "verifier-2"):
            cluster.verifier(v, model=target, speculation="on")
        cluster.drafter("drafter-1", model=draft)
        cluster.router(model=target, drafter_models={"drafter-1": digest}, name="router",
                       contract={"rule": 1, "m_max": 6, "max_new": MAX_NEW, "low_rounds": 4,
                                 "fallback": ["reduce", "switch"]})
        bed.start()
        # every certificate names its host's address
        for name, instance in cluster.instances.items():
            pem = cluster.workdir / "certs" / f"{instance_file_name(instance.uri)}.pem"
            cert = x509.load_pem_x509_certificate(pem.read_bytes())
            ips = {str(a) for a in cert.extensions.get_extension_for_class(
                x509.SubjectAlternativeName).value.get_values_for_type(x509.IPAddress)}
            assert bed.net.address(name) in ips, (name, ips)
        assert bed.etcd.leader() in bed.etcd.hosts
        router = cluster.instances["router"]
        fd = FrontDoorClient(router.frontdoor_url, timeout=120)
        try:
            fd.wait_live(3, timeout=60)
            prompts = [[rng.randrange(32) for _ in range(rng.randint(2, 5))] for _ in range(3)]
            fields = [{}, {}, {"rule": 2, "sampling": {"temperature_milli": 1000, "seed": rng.randrange(1 << 31)}}]
            point = rng.randint(5, MAX_NEW // 2)
            with ThreadPoolExecutor(len(prompts)) as pool:
                futures = [pool.submit(fd.generate, p, max_new=MAX_NEW, **f) for p, f in zip(prompts, fields,
                                                                                           strict=True)]
                victim = wait_until(lambda: next((g for g in fd.generations() if g["finish"] is None
                                                  and g["committed"] >= point), None), 120,
                                    f"nothing reached {point} tokens (SDCP_FAULT_SEED={seed})")
                cut = next(i for i in cluster.instances.values() if i.uri == victim["verifier"])
                bed.net.cut(cut.name)
                t0 = time.monotonic()
                at_cut = fd.info(victim["id"])["committed"]
                wait_until(lambda: fd.info(victim["id"])["epoch"] >= 2, 60,
                           f"no failover from {cut.name} (SDCP_FAULT_SEED={seed})")
                failover = time.monotonic() - t0
                # recovery: the cut until the session commits again (on the other verifier)
                recovery = failover + wait_committed_past(fd, victim["id"], at_cut, 60)
                ttl = cut.config.verifier.ttl_ms / 1000
                bound = recovery_bound(ttl, cluster.instances["router"].config.router.stall_s)
                print(f"cut {cut.name} at {point} tokens; failed over after {failover:.2f} s, committing "
                      f"again after {recovery:.2f} s (bound {bound:g} s)")
                assert recovery <= bound, f"recovery {recovery:.2f} s, bound {bound:g} s (SDCP_FAULT_SEED={seed})"
                bed.net.restore(cut.name)
                results = [f.result(timeout=180) for f in futures]
            assert cut.alive(), "the cut-off verifier died"
            for prompt, field, result in zip(prompts, fields, results, strict=True):
                where = f"rule {field.get('rule', 1)}, cut at {point} tokens (SDCP_FAULT_SEED={seed})"
                assert result["end"]["finish"] == "finish", f"{where}: {result['end']}"
                assert len(result["tokens"]) == MAX_NEW, where
                logged = asyncio.run(committed_tokens(bed.commit_log, result["id"]))
                assert result["tokens"] == logged, f"{where}: the stream is not what the log committed"
                if "rule" not in field:
                    assert result["tokens"] == greedy(target, prompt, MAX_NEW), where
        finally:
            fd.close()
