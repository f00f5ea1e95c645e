"""A TCP forwarder on loopback, run as its own process by the fault tests to stand for the
network between an instance and the rest of the deployment:

    python loopback_proxy.py LISTEN_PORT:TARGET_PORT [LISTEN_PORT:TARGET_PORT ...]

It forwards bytes only (TLS passes through, so the peers still see each other's
certificates). A partition is this process stopped with SIGSTOP: connections already open
and new ones alike go silent (the kernel still completes handshakes into the backlog, as a
black-holing network would let SYNs through and drop the rest); SIGCONT heals it.
It prints `ready` once every listener is bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


def forward_to(target: int):
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", target), 5)
        except (OSError, TimeoutError):
            writer.close()
            return
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
    return handle


async def main(pairs: list[tuple[int, int]]) -> None:
    servers = [await asyncio.start_server(forward_to(target), "127.0.0.1", listen)
               for listen, target in pairs]
    print("ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


if __name__ == "__main__":
    asyncio.run(main([tuple(map(int, arg.split(":"))) for arg in sys.argv[1:]]))
