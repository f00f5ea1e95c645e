"""Free loopback ports for the instances, stores and pages that tests and `sdcp-fast up`
start.

A port is drawn at random below the kernel's ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range), never from it: a port taken with bind(0) and
closed again is an ephemeral one, which any outgoing connection of the machine may take
before the process meant for it listens (seen in CI: "frontdoor: cannot listen on
127.0.0.1:49991: Address already in use"). Below that range only a listener takes a port.
It must be free for TCP and UDP (an instance serves HTTP/3 on its HTTP/2 number), and one
process never hands out the same port twice.
"""

from __future__ import annotations

import random
import socket

LOWEST = 10000
_handed_out: set[int] = set()
_draw = random.SystemRandom()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768                      # Linux's default


def _free(host: str, port: int) -> bool:
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        with socket.socket(socket.AF_INET, kind) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port free for both TCP and UDP, outside the ephemeral range."""
    high = _ephemeral_low()
    if high - LOWEST < 1000:          # an unusual range: take what bind(0) gives
        low, high = 1024, 65536
    else:
        low = LOWEST
    for _ in range(200):
        port = _draw.randrange(low, high)
        if port not in _handed_out and _free(host, port):
            _handed_out.add(port)
            return port
    raise OSError("no free port")
