"""How long the strict decoder takes to reject hostile input, per input size.

For each size, crafted worst cases (many tiny items refused at the end, lying heads, deep
nesting, duplicate keys at the end, invalid UTF-8 at the end, closed maps full of unknown
keys, token lists with a bad last token) and random mutations of valid messages are decoded
as the message type a route would (Proposal up to 64 KiB, SessionOpen beyond: the largest
body a router may send). Each input is timed as the best of `--repeat` runs (the machine is
shared); the slowest input per size is printed with its time per byte. Rejection time must
grow at most linearly in the input: the last line gives the worst nanoseconds per byte.

    .venv/bin/python bench/bench_decode.py [--sizes 256,4096,65536,1048576] [--mutations 300]
"""

from __future__ import annotations

import argparse
import random
import struct
import time

from sdcp_fast.core import cbor
from sdcp_fast.core.messages import Contract, Proposal, Sampling, SessionOpen, Status
from sdcp_fast.core.problems import ProblemError

SMALL_ROUTE_LIMIT = 64 << 10


def crafted(n: int) -> dict[str, bytes]:
    """Hostile inputs of about n bytes, each refused only after reading (almost) all of it."""
    tokens = n // 5
    at_limit = min(n - 6, cbor.DEFAULT_MAX_ITEMS - 8)
    return {
        "tiny items, bad last": b"\x9a" + struct.pack(">I", n - 6) + b"\x00" * (n - 6) + b"\xff",
        "nested arrays": (b"\x82" + b"\x00") * 15 + b"\x81" * (n // 2),
        "duplicate key last": b"\xba" + struct.pack(">I", n // 4) + b"".join(
            cbor.dumps(k) + b"\x00" for k in range(n // 4 - 1)) + b"\x00\x00",
        "length lies": b"\x5b" + struct.pack(">Q", 1 << 60) + b"\x00" * (n - 9),
        "bad utf-8 last": b"\x7a" + struct.pack(">I", n - 5) + b"a" * (n - 6) + b"\xff",
        "floats, bad last": b"\x9a" + struct.pack(">I", n // 9) + (b"\xfb" + b"\x00" * 8) * (n // 9 - 1)
        + b"\xf7",
        "unknown keys (closed map)": cbor.dumps({"contract": {f"k{i}": i for i in range(n // 8)}}),
        "bad last token": cbor.dumps({"session": b"\x01" * 16, "epoch": 1, "round": 1,
                                      "tokens": [7] * (tokens - 1) + [1 << 40]}),
        "prompt of maps": cbor.dumps({"prompt": [{}] * (n - 40)}),
        "strings array": cbor.dumps(["ab"] * (n // 3)),
        "tags": b"\x9a" + struct.pack(">I", n // 2) + b"\x00" * (n // 2 - 2) + b"\xc1\x00",
        # as many items as a session-open may hold, each on the slow path (empty maps)
        "maps up to the item limit": b"\x9a" + struct.pack(">I", at_limit) + b"\xa0" * (at_limit - 1) + b"\xff",
    }


def valid_messages(n: int) -> list[bytes]:
    digest = bytes(range(32))
    contract = Contract(target=digest, tokenizer=digest, rule=2, m_max=8, max_new=100, stop=(2,),
                        low_rounds=4, fallback=(1, 2, 3), sampling=Sampling(temperature_milli=700))
    prompt = tuple(random.randrange(50_000) for _ in range(max(1, n // 4)))
    status = Status("https://drafter-1.example/", 1, 30, 2, 2000)
    return [
        Proposal(b"\x01" * 16, 1, 1, "https://drafter-1.example/", 0, digest, tuple(range(8)), status,
                 q_rows="q/ref").to_cbor(),
        SessionOpen(b"\x02" * 16, 1, contract, prompt, "log").to_cbor(),
    ]


def mutate(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 6)):
        choice = rng.random()
        pos = rng.randrange(len(out)) if out else 0
        if choice < 0.4 and out:
            out[pos] = rng.randrange(256)
        elif choice < 0.6:
            out[pos:pos] = bytes([rng.choice([0x9b, 0xbb, 0x5b, 0x7b, 0x9f, 0xbf, 0xd8, 0xff, 0x81])])
        elif choice < 0.8 and out:
            del out[pos:pos + rng.randint(1, 8)]
        else:
            out[pos:pos] = out[pos:pos + rng.randint(1, 64)]
    return bytes(out)


def decode(kind, data: bytes) -> bool:
    """True when refused (a problem), False when accepted."""
    try:
        kind.from_cbor(data, max_size=max(len(data), 1))
    except ProblemError:
        return True
    return False


def timed(kind, data: bytes, repeat: int) -> tuple[float, bool]:
    best = float("inf")
    refused = True
    for _ in range(repeat):
        start = time.perf_counter_ns()
        refused = decode(kind, data)
        best = min(best, time.perf_counter_ns() - start)
    return best, refused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256,4096,65536,1048576")
    parser.add_argument("--mutations", type=int, default=300, help="random mutations per size")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=22)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    random.seed(args.seed)
    worst = (0.0, "", 0)
    print(f"{'size':>9} {'inputs':>7} {'slowest rejection':>18} {'ns/byte':>8}  input")
    for n in map(int, args.sizes.split(",")):
        kind = Proposal if n <= SMALL_ROUTE_LIMIT else SessionOpen
        inputs = {name: data for name, data in crafted(n).items()}
        for index, base in enumerate(valid_messages(n)):
            for m in range(args.mutations):
                inputs[f"mutation {index}.{m}"] = mutate(base, rng)
        slowest = (0.0, "", 0)
        for name, data in inputs.items():
            ns, refused = timed(kind, data, args.repeat)
            if refused and ns > slowest[0]:
                slowest = (ns, name, len(data))
        ns, name, size = slowest
        per_byte = ns / max(size, 1)
        print(f"{n:>9} {len(inputs):>7} {ns / 1e3:>15.1f} us {per_byte:>8.1f}  {name} ({size} bytes)")
        if per_byte > worst[0] and size >= 1024:
            worst = (per_byte, name, size)
    per_byte, name, size = worst
    print(f"slowest rejection {per_byte:.1f} ns/byte ({name}, {size} bytes)")


if __name__ == "__main__":
    main()
