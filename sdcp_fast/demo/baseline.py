"""The demo's comparison: the same prompts decoded by the target alone (greedy, one forward
pass per token), batched as the verifier had them and one at a time."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class Baseline:
    """The target alone, greedy: outputs and times, prompts batched and one at a time."""

    outputs: list[list[int]]
    batched_s: float               # all prompts in each forward pass
    each_s: list[float]            # each prompt decoded alone

    @property
    def tokens(self) -> int:
        return sum(len(t) for t in self.outputs)


def target_alone(backend, prompts: list[list[int]], lengths: list[int]) -> Baseline:
    """Greedy decoding by the target alone, one forward pass per token: once with every
    prompt in each pass (the concurrency the verifier had), once prompt by prompt."""
    # torch's default threads: the whole machine, as the serving processes take the free
    # cores per call (cores.py)
    outputs, batched = decode_alone(backend, prompts, lengths)
    each = []
    for n in range(len(prompts)):
        single, seconds = decode_alone(backend, prompts[n:n + 1], lengths[n:n + 1])
        assert single[0] == outputs[n], "the target's greedy decoding is not deterministic"
        each.append(seconds)
    return Baseline(outputs, batched, each)


def decode_alone(backend, prompts, lengths) -> tuple[list[list[int]], float]:
    import torch

    ids = [f"alone-{n}".encode() for n in range(len(prompts))]
    for sid, prompt in zip(ids, prompts, strict=True):
        backend.open(sid, prompt)
    outputs: list[list[int]] = [[] for _ in prompts]
    started = time.perf_counter()
    active = [n for n in range(len(prompts)) if lengths[n] > 0]
    while active:
        logits = backend.score([(ids[n], []) for n in active])      # [len(active), V]
        for row, n in enumerate(active):
            token = int(torch.argmax(logits[row]))
            backend.commit(ids[n], [token])
            outputs[n].append(token)
        active = [n for n in active if len(outputs[n]) < lengths[n]]
    wall = time.perf_counter() - started
    for sid in ids:
        backend.release(sid)
    return outputs, wall
