"""The typed commit-record layer (sdcp_fast/commits.py) stores exactly the record's
deterministic CBOR, so logs written before it (raw `append` of `to_cbor()`) read back the
same, and the read-after-append check recognises its own append only."""

from __future__ import annotations

import asyncio
import random

from sdcp_fast import commits
from sdcp_fast.cache import Conflict, open_log
from sdcp_fast.commits import (
    RecordAppend,
    append_records,
    landed,
    read_records,
    record_bytes,
    record_of,
)
from sdcp_fast.core import cbor
from sdcp_fast.core.messages import Action, CommitRecord, Contract, Sampling
from sdcp_fast.refs import contract_from_text, contract_text


def record(epoch: int, round: int, emitted: tuple[int, ...], committed: int) -> CommitRecord:
    return CommitRecord(epoch, round, emitted, committed, bytes(range(32)))


def test_record_bytes_are_the_records_cbor():
    """The direct encoding equals the generic deterministic one at every head size."""
    assert commits._DIRECT   # CommitRecord's members as the direct encoder knows them
    rng = random.Random(18)
    edges = [0, 23, 24, 255, 256, 65535, 65536, (1 << 32) - 1]
    wide = [*edges, (1 << 32), (1 << 64) - 1]
    for n in range(2000):
        size = rng.choice([0, 1, 5, 23, 24, 65, 300]) if n % 3 else rng.randrange(0, 70)
        emitted = tuple(rng.choice(edges) if rng.random() < 0.3 else rng.randrange(1 << rng.choice([5, 8, 16, 32]))
                        for _ in range(size))
        r = CommitRecord(rng.choice(wide), rng.choice(edges), emitted, rng.choice(wide), rng.randbytes(32))
        assert record_bytes(r) == r.to_cbor() == cbor.dumps(r.to_obj())
        assert CommitRecord.from_cbor(record_bytes(r)) == r


def test_records_are_stored_as_their_cbor_and_read_back_typed(tmp_path):
    async def main():
        log = await open_log(f"file:{tmp_path}")
        try:
            old = record(1, 1, (5, 6), 2)
            await log.append("a", old.to_cbor(), epoch=1, expected=0)     # as written before the layer
            new = [RecordAppend("a", record(1, 2, (7,), 3), 1, 1), RecordAppend("b", record(2, 1, (9,), 1), 2, 0)]
            for group in (True, False):
                answers = await append_records(log, new, group=group)
                if group:
                    assert answers == [2, 1]
                else:   # the same appends again: each refused at its position
                    assert [type(a) for a in answers] == [Conflict, Conflict]
            entries = await log.read("a")
            assert [e.record for e in entries] == [old.to_cbor(), new[0].record.to_cbor()]
            assert [record_of(e) for e in entries] == [old, new[0].record]
            assert await read_records(log, "a") == [old, new[0].record]
            assert landed(entries[1], new[0])
            assert not landed(entries[1], RecordAppend("a", record(1, 2, (8,), 3), 1, 1))   # another record
            assert not landed(entries[1], RecordAppend("a", new[0].record, 2, 1))           # another epoch
            await log.fence("a", 3)
            assert await read_records(log, "a") == [old, new[0].record]
        finally:
            await log.close()
    asyncio.run(main())


def test_contract_text_round_trips_as_hex_cbor():
    contract = Contract(target=bytes(32), tokenizer=bytes(32), rule=2, m_max=4, max_new=9, stop=(3,),
                        low_rounds=3, fallback=(Action.REDUCE, Action.SWITCH), sampling=Sampling(seed=4))
    assert contract_text(contract) == contract.to_cbor().hex()      # what router records hold
    assert contract_from_text(contract_text(contract)) == contract
