"""load_q_rows and QRowStager: exact rows, in order, one tensor; typed errors for missing or
mis-sized rows; fetches ahead in a bounded pool of reused buffers."""

from __future__ import annotations

from asyncio import run

import pytest
import torch
from cache_workers import q_rows

from sdcp_fast.cache import open_store
from sdcp_fast.cache.qrows import QRowStager, QRowsUnavailable, load_q_rows

VOCAB = 101


async def _put_batch(store, ms):
    for i, m in enumerate(ms):
        await store.put(f"mlc:/q/{i}", q_rows(3, i, m, VOCAB).numpy().tobytes(), lease_ms=60_000)


def test_batch_lands_in_one_tensor_in_order(store_spec):
    ms = [2, 5, 1, 3]

    async def body():
        store = await open_store(store_spec)
        try:
            await _put_batch(store, ms)
            refs = [(f"mlc:/q/{i}", m) for i, m in enumerate(ms)]
            return await load_q_rows(store, refs, VOCAB, torch.device("cpu"))
        finally:
            await store.close()

    rows = run(body())
    assert rows.shape == (sum(ms), VOCAB) and rows.dtype == torch.float32
    assert rows.device.type == "cpu" and rows.is_contiguous()
    assert torch.equal(rows, torch.cat([q_rows(3, i, m, VOCAB) for i, m in enumerate(ms)]))


@pytest.mark.parametrize("claimed_m", [1, 3])
def test_size_mismatch_is_q_unavailable(store_spec, claimed_m):
    async def body():
        store = await open_store(store_spec)
        try:
            await _put_batch(store, [2, 2])
            with pytest.raises(QRowsUnavailable) as err:
                await load_q_rows(store, [("mlc:/q/0", 2), ("mlc:/q/1", claimed_m)], VOCAB)
            return err.value
        finally:
            await store.close()

    error = run(body())
    assert error.uri == "mlc:/q/1" and error.problem == "sdcp-q-unavailable"
    assert f"{2 * VOCAB * 4} bytes" in error.reason and f"{claimed_m * VOCAB * 4}" in str(error)


def test_missing_object_is_q_unavailable(store_spec):
    async def body():
        store = await open_store(store_spec)
        try:
            await _put_batch(store, [2])
            with pytest.raises(QRowsUnavailable) as err:
                await load_q_rows(store, [("mlc:/q/0", 2), ("mlc:/q/gone", 2)], VOCAB)
            return err.value
        finally:
            await store.close()

    error = run(body())
    assert error.uri == "mlc:/q/gone" and error.reason == "not found"


def test_rows_land_in_a_reused_buffer(shm_dir):
    async def body():
        store = await open_store(f"embedded:{shm_dir}")
        try:
            await _put_batch(store, [2, 3])
            buffer = torch.full((8, VOCAB), -1.0)
            rows = await load_q_rows(store, [("mlc:/q/1", 3), ("mlc:/q/0", 2)], VOCAB,
                                     out=buffer)
            with pytest.raises(ValueError):
                await load_q_rows(store, [("mlc:/q/0", 2)], VOCAB, out=buffer[:, :50])
            with pytest.raises(ValueError):
                await load_q_rows(store, [("mlc:/q/0", 2)], VOCAB, out=buffer.double())
            return buffer, rows
        finally:
            await store.close()

    buffer, rows = run(body())
    assert rows.data_ptr() == buffer.data_ptr() and rows.shape == (5, VOCAB)
    assert torch.equal(rows, torch.cat([q_rows(3, 1, 3, VOCAB), q_rows(3, 0, 2, VOCAB)]))
    assert torch.equal(buffer[5:], torch.full((3, VOCAB), -1.0))  # rows past sum M untouched


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        run(load_q_rows(None, [("mlc:/q/0", 0)], VOCAB))
    with pytest.raises(ValueError):
        run(load_q_rows(None, [("mlc:/q/0", 1)], 0))


@pytest.mark.gpu
def test_cuda_target_lands_rows_on_device(shm_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ms = [4, 2, 64]

    async def body():
        store = await open_store(f"embedded:{shm_dir}")
        try:
            await _put_batch(store, ms[:2])
            # The third lives in the GPU tier: copied device to device.
            await store.put_tensor("mlc:/q/2", q_rows(3, 2, ms[2], VOCAB).cuda(), lease_ms=60_000)
            refs = [(f"mlc:/q/{i}", m) for i, m in enumerate(ms)]
            return await load_q_rows(store, refs, VOCAB, "cuda")
        finally:
            await store.close()

    rows = run(body())
    assert rows.is_cuda and rows.shape == (sum(ms), VOCAB)
    expected = torch.cat([q_rows(3, i, m, VOCAB) for i, m in enumerate(ms)])
    assert torch.equal(rows.cpu(), expected)


def test_stager_fetches_ahead_in_a_bounded_pool_and_reuses_its_buffers(shm_dir):
    """QRowStager: fetches start when asked while the pool has room (the rest wait for
    land), rows land in order in one reused tensor, slots are reused, failures dropped."""
    row_bytes = VOCAB * 4

    async def body():
        store = await open_store(f"embedded:{shm_dir}")
        try:
            await _put_batch(store, [2, 3, 2])
            stager = QRowStager(store, VOCAB, "cpu", host_bytes=5 * row_bytes)
            first = [stager.fetch(f"mlc:/q/{i}", m) for i, m in enumerate([2, 3, 2])]
            early = [f.early for f in first]
            landed = await stager.land(first)
            rows_1, ptr_1 = landed.q.clone(), landed.q.data_ptr()
            slot_ptrs = {f.slot.data_ptr() for f in first if f.slot is not None}
            stager.release(first, after=landed.ready)
            pooled_after_first = stager.pooled_bytes

            again = [stager.fetch("mlc:/q/1", 3), stager.fetch("mlc:/q/gone", 2)]
            reused = again[0].slot.data_ptr() in slot_ptrs
            landed_2 = await stager.land(again)
            stager.release(again, after=landed_2.ready)
            return (early, rows_1, ptr_1, pooled_after_first, reused, landed_2,
                    stager.pooled_bytes)
        finally:
            await store.close()

    early, rows_1, ptr_1, pooled_1, reused, landed_2, pooled_2 = run(body())
    assert early == [True, True, False]          # 2 + 3 rows fill the pool; the third waits
    assert torch.equal(rows_1, torch.cat([q_rows(3, i, m, VOCAB) for i, m in enumerate([2, 3, 2])]))
    assert pooled_1 == 5 * row_bytes             # bounded, kept for the next rounds
    assert reused and landed_2.q.data_ptr() == ptr_1  # same host slot, same batch tensor
    assert landed_2.starts == {0: 0} and set(landed_2.problems) == {1}
    assert landed_2.problems[1].reason == "not found"
    assert torch.equal(landed_2.q[:3], q_rows(3, 1, 3, VOCAB))
    assert pooled_2 == 3 * row_bytes             # the failed fetch's slot was dropped
    assert landed_2.read_seconds() > 0


@pytest.mark.gpu
def test_stager_on_cuda_pins_slots_maps_gpu_tier_and_waits_on_an_event(shm_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ms = [4, 2]

    async def body():
        store = await open_store(f"embedded:{shm_dir}")
        try:
            await _put_batch(store, ms[:1])
            await store.put_tensor("mlc:/q/1", q_rows(3, 1, ms[1], VOCAB).cuda(), lease_ms=60_000)
            stager = QRowStager(store, VOCAB, "cuda")
            fetches = [stager.fetch(f"mlc:/q/{i}", m) for i, m in enumerate(ms)]
            landed = await stager.land(fetches)
            kinds = [(f.slot is not None and f.slot.is_pinned(), f.mapped is not None) for f in fetches]
            stager.device.wait(landed.ready)
            rows = landed.q.cpu()
            stager.release(fetches, after=landed.ready)
            return kinds, rows, landed
        finally:
            await store.close()

    kinds, rows, landed = run(body())
    assert kinds == [(True, False), (True, True)]   # host tier via pinned slot; GPU tier mapped
    assert torch.equal(rows, torch.cat([q_rows(3, i, m, VOCAB) for i, m in enumerate(ms)]))
    assert landed.ready.done() and landed.ready.since(landed.copies_began) >= 0
