"""The comparisons for a transformers target (`hf:`): greedy `generate()` with the target
alone, one prompt at a time and batched, and transformers' assisted generation (prompt
lookup, or a transformers assistant model), on chat prompts with the end-of-turn token as
the stop. Shared by the demo's real pair and bench/bench_real.py.

Outputs are continuations up to and including the stop token, as SDCP commits them."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

END_OF_TURN = "<|im_end|>"   # ChatML, SmolLM2's chat format


def chat_prompts(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text as one user turn through the tokenizer's chat template, ready to answer."""
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=False))
            for text in texts]


def end_of_turn(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids(END_OF_TURN)


@dataclass
class Decoded:
    """A way of decoding: its continuations and the seconds each prompt (or the batch) took."""

    outputs: list[list[int]]
    seconds: list[float]
    started: float = 0.0      # perf_counter when the (first) call began

    @property
    def tokens(self) -> int:
        return sum(map(len, self.outputs))

    @property
    def rate(self) -> float:
        return self.tokens / sum(self.seconds) if sum(self.seconds) else 0.0


def until_stop(tokens: list[int], eos: int) -> list[int]:
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


class _StockAttention:
    """The model with transformers' stock SDPA attention for the block (the hf: backend
    registers its own packed attention): the target alone, as transformers ships it."""

    def __init__(self, model):
        self.model, self.own = model, model.config._attn_implementation

    def __enter__(self):
        self.model.set_attn_implementation("sdpa")
        return self.model

    def __exit__(self, *exc):
        self.model.set_attn_implementation(self.own)


@torch.no_grad()
def generate_each(model, prompts: list[list[int]], max_new: int, eos: int, **assist) -> Decoded:
    """generate(), greedy, one prompt at a time; `assist` passes assisted generation's
    arguments (prompt_lookup_num_tokens=N, or assistant_model=MODEL)."""
    with _StockAttention(model):
        outputs, seconds = [], []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            started = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new, eos_token_id=eos, pad_token_id=eos, **assist)
            seconds.append(time.perf_counter() - started)
            outputs.append(until_stop(out[0, len(prompt):].tolist(), eos))
        return Decoded(outputs, seconds)


@torch.no_grad()
def generate_batched(model, prompts: list[list[int]], max_new: int, eos: int, **options) -> Decoded:
    """generate(), greedy, all prompts in one left-padded batch (with its attention mask):
    transformers' own way to serve several prompts at once. Padding changes the arithmetic,
    so its outputs are not the reference; only its time is. `options` go to generate() (a
    streamer, sampling instead of greedy)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    options = {"do_sample": False, **options}
    with _StockAttention(model):
        started = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, eos_token_id=eos,
                             pad_token_id=eos, **options)
        seconds = time.perf_counter() - started
    return Decoded([until_stop(row[width:].tolist(), eos) for row in out], [seconds], started)
