"""Memory per session: what a verifier really holds, what it reserves, and a real model's KV.

1. A verifier (in-process, embedded store, file commit log) opens `--sessions` sessions with
   a `--prompt`-token prompt and leaves them (the abandoned-sessions attack), once with the
   table model and once with the tiny model (tiny:demo-target, a real per-session KV cache).
   Printed per session: Python heap measured with tracemalloc (the verifier's records and
   the model's token lists and KV tensors' storage, which torch allocates outside
   tracemalloc, added from `Backend.session_bytes`), and the reservation the memory budget
   counts (`VerifierService.reservation`), which must not be below it.
2. Then the same verifier with a budget (`--budget-mb`): sessions are opened until it
   answers `capacity`; the reserved total stays within the budget whatever is sent.
3. A real model's KV cache: SmolLM2-135M's shape (30 layers, 3 KV heads of 64, the model
   the demo serves), random weights, 2 layers built and scaled to 30, a transformers
   DynamicCache filled by one forward pass: bytes per token, and per session at 2048 and
   8192 tokens, fp32 and bf16.

    .venv/bin/python bench/bench_session_memory.py [--sessions 1500] [--prompt 32] [--budget-mb 64]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import tempfile
import tracemalloc
import warnings
from pathlib import Path

import torch

from sdcp_fast.cache import open_log, open_store
from sdcp_fast.core.messages import Action, Contract, SessionOpen
from sdcp_fast.models import load_backend
from sdcp_fast.models.table import write_table
from sdcp_fast.refs import commit_log_name
from sdcp_fast.transport import Request
from sdcp_fast.transport.http import dispatch
from sdcp_fast.verifier import VerifierConfig, VerifierService

ROUTER = "https://router.bench/"


async def verifier(workdir: Path, spec: str, budget: int) -> VerifierService:
    backend = load_backend(spec)
    store = await open_store(f"embedded:{workdir / 'mlc'}")
    log = await open_log(f"file:{workdir / 'log'}")
    service = VerifierService(VerifierConfig("https://v.bench/", frozenset({ROUTER}),
                                             memory_budget_bytes=budget, retire_idle_s=3600.0),
                              backend, store, log)
    await service.start()
    service.closers = (store, log)
    return service


async def open_sessions(service: VerifierService, count: int, prompt_len: int) -> tuple[int, list[bytes]]:
    backend = service.target.backend
    contract = Contract(target=backend.digest, tokenizer=backend.tokenizer_digest, rule=1, m_max=8, max_new=128,
                        stop=(), low_rounds=3, fallback=(Action.REDUCE,))
    prompt = tuple((7 * n + 3) % min(backend.vocab_size, 250) for n in range(prompt_len))
    opened = []
    for _ in range(count):
        sid = os.urandom(16)
        body = SessionOpen(sid, 1, contract, prompt, commit_log_name(sid)).to_cbor()
        answer = await dispatch(service, Request("POST", "/sessions", {}, "application/sdcp+cbor", body, ROUTER))
        if answer.status != 200:
            return answer.status, opened
        opened.append(sid)
    return 200, opened


async def per_session(spec: str, count: int, prompt_len: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        service = await verifier(Path(tmp), spec, 1 << 40)
        await open_sessions(service, 5, prompt_len)                 # warm: imports, caches
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        status, opened = await open_sessions(service, count, prompt_len)
        gc.collect()
        heap = (tracemalloc.get_traced_memory()[0] - before) / len(opened)
        tracemalloc.stop()
        backend = service.target.backend
        model = sum(backend.session_bytes(sid) for sid in opened) / len(opened)
        tensors = sum(_tensor_bytes(backend, sid) for sid in opened) / len(opened)
        reserved = service.sessions.get(opened[0]).reserved
        await service.stop()
        for closer in service.closers:
            await closer.close()
        return {"heap": heap, "model": model, "measured": heap + tensors, "reserved": reserved}


def _tensor_bytes(backend, sid: bytes) -> int:
    """KV and logits tensors' storage (torch allocates it outside tracemalloc)."""
    session = getattr(backend, "_sessions", {}).get(sid)
    total = 0
    for name in ("buffer", "rows"):
        tensor = getattr(session, name, None)
        if isinstance(tensor, torch.Tensor):
            total += tensor.untyped_storage().nbytes()
    return total


async def budget_holds(spec: str, budget: int, prompt_len: int) -> tuple[int, int, int]:
    with tempfile.TemporaryDirectory() as tmp:
        service = await verifier(Path(tmp), spec, budget)
        status, opened = await open_sessions(service, 100_000, prompt_len)
        reserved = service.sessions.reserved_bytes
        await service.stop()
        for closer in service.closers:
            await closer.close()
        return status, len(opened), reserved


def real_model_kv() -> dict:
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    layers = 2
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    tokens = 256
    cache = DynamicCache()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)   # transformers 5 renames past_key_values
        model(torch.randint(0, 49152, (1, tokens)), past_key_values=cache, use_cache=True)
    total = 0
    for layer in cache.layers:
        total += layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
    per_token_layer = total / tokens / layers
    formula = 2 * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 4
    return {"per_token_layer": per_token_layer, "formula": formula, "per_token_fp32": per_token_layer * 30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=1500)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--budget-mb", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        table = Path(tmp) / "table.safetensors"
        write_table(table, torch.randn(256, 256))
        specs = {"table (V=256)": f"table:{table}", "tiny:demo-target": "tiny:demo-target"}
        print(f"{'model':<18} {'sessions':>8} {'heap/session':>13} {'model/session':>14} "
              f"{'measured':>10} {'reserved':>10}")
        for name, spec in specs.items():
            r = asyncio.run(per_session(spec, args.sessions, args.prompt))
            print(f"{name:<18} {args.sessions:>8} {r['heap'] / 1024:>10.1f} KiB {r['model'] / 1024:>11.1f} KiB "
                  f"{r['measured'] / 1024:>6.1f} KiB {r['reserved'] / 1024:>6.1f} KiB")
            assert r["reserved"] >= r["measured"], f"{name}: reservation below what a session holds"
        for name, spec in specs.items():
            status, count, reserved = asyncio.run(budget_holds(spec, args.budget_mb << 20, args.prompt))
            print(f"budget {args.budget_mb} MiB, {name}: {count} sessions admitted, then {status}; "
                  f"{reserved / 2**20:.1f} MiB reserved")
    kv = real_model_kv()
    print(f"SmolLM2-135M KV (fp32): {kv['per_token_layer']:.0f} B per token and layer (formula "
          f"2 x 3 heads x 64 x 4 B = {kv['formula']}), {kv['per_token_fp32'] / 1024:.1f} KiB per token for "
          f"30 layers; a 2048-token session {kv['per_token_fp32'] * 2048 / 2**20:.0f} MiB, 8192 tokens "
          f"{kv['per_token_fp32'] * 8192 / 2**20:.0f} MiB (bf16: half)")


if __name__ == "__main__":
    main()
