"""`python -m sdcp_fast.hosts.reaper CLIENT_LINK NAMESPACE...`: waits until its stdin closes
(the harness that started it has ended, however it ended), then kills every process left in
the namespaces and deletes them and the client link. Started by `netns.Network.up()` in a
session of its own, so a signal to the harness's process group does not reach it."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys

from .netns import ip, remove_namespaces


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    client_link, namespaces = argv[0], argv[1:]
    with contextlib.suppress(OSError):
        while sys.stdin.buffer.read(4096):
            pass
    present = set(ip("netns", "list", check=False).stdout.split())
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        remove_namespaces([n for n in reversed(namespaces) if n in present])
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        ip("link", "del", client_link, check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
