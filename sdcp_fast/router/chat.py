"""What the OpenAI routes need from the target's tokenizer: the chat prompt and the
end-of-sequence tokens.

- `chat_prompt(backend, messages) -> [ids]`: the tokenizer's own chat template when it has
  one (Hugging Face tokenizers: `apply_chat_template(..., add_generation_prompt=True)`).
  A tokenizer without one (the demo's byte tokenizer, table models) gets the documented
  plain fallback, one line per message and an open assistant turn:

      system: You are terse.
      user: Hello
      assistant:

  (with a space after the last colon). The demo pair was trained on Python code, so its
  chat is no conversation, but the API works the same way for it as for a real model.
- `hf_tokenizer(backend)`: the transformers tokenizer behind any backend's tokenizer, held
  directly (`hf:`) or inside the `HFTokenizer` wrapper (`gguf:`, `distilled:`, `ngram:`).
- `eos_ids(backend) -> {ids}`: the tokens that end a generation by default: the tokenizer's
  eos token, the model's generation config eos ids, and the usual end-of-turn tokens when
  the vocabulary has them (`<|im_end|>`, `<|eot_id|>`, `<|end|>`, `<|endoftext|>`).
  None for the byte and table tokenizers.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..models.real_tokenizer import chat_template_ids

WRAPPER_DEPTH = 3   # backend.tokenizer (a wrapper).tokenizer (transformers'): 2 is enough
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "<|end_of_text|>", "</s>")


def hf_tokenizer(backend):
    """The Hugging Face (transformers) tokenizer behind a backend, or None. `hf:` backends
    hold it as `backend.tokenizer`; `gguf:`, `distilled:` and `ngram:` hold an `HFTokenizer`
    wrapper (models/real_tokenizer.py) with it as `.tokenizer`; the byte and table
    tokenizers have none. Follows `.tokenizer` until an object with a chat template method."""
    tokenizer = getattr(backend, "tokenizer", None)
    for _ in range(WRAPPER_DEPTH):
        if tokenizer is None or hasattr(tokenizer, "apply_chat_template"):
            return tokenizer
        tokenizer = getattr(tokenizer, "tokenizer", None)
    return None


def has_template(backend) -> bool:
    tokenizer = hf_tokenizer(backend)
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def chat_prompt(backend, messages: Sequence[dict[str, str]]) -> list[int]:
    """Prompt token ids for `messages` ([{"role", "content"}], content already text)."""
    if has_template(backend):
        return chat_template_ids(hf_tokenizer(backend), messages)
    return backend.encode(fallback_text(messages))


def fallback_text(messages: Sequence[dict[str, str]]) -> str:
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nassistant: "


def eos_ids(backend) -> frozenset[int]:
    ids: set[int] = set()
    tokenizer = hf_tokenizer(backend)
    if tokenizer is not None:
        if getattr(tokenizer, "eos_token_id", None) is not None:
            ids.add(int(tokenizer.eos_token_id))
        vocab = tokenizer.get_vocab()
        ids.update(int(vocab[name]) for name in END_OF_TURN if name in vocab)
    config = getattr(getattr(backend, "model", None), "generation_config", None)
    configured = getattr(config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif isinstance(configured, list | tuple):
        ids.update(int(t) for t in configured)
    return frozenset(t for t in ids if 0 <= t < backend.vocab_size)
