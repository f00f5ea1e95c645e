"""One forward pass of a transformers causal LM over the new tokens of many sessions, each
on top of its own `DynamicCache`: a packed ragged batch, no padding, no copies of the past.

The new tokens of all sessions are packed into one row [1, T] with each token's own
position id; embeddings, projections, MLPs and the output head run once over the T tokens.
Attention is the only per-session step: an attention function registered with
transformers' `AttentionInterface` (the extension point vLLM and TGI use) receives the
packed keys and values of a layer, appends each session's slice to that session's cache
(`DynamicCache.update`) and runs torch's SDPA for the session's queries over its whole
cache, with a causal mask offset by its cached length.

    spans = [Span(lo, hi, cache, mask) ...]     # packed rows lo:hi belong to `cache`
    model(input_ids=[1, T], position_ids=[1, T], use_cache=False,
          sdcp_ragged=RaggedLayout(spans))      # the layout travels in the model's kwargs

For a packed call transformers still builds its own causal mask over the packed row (it
sees no cache; a [1, 1, T, T] bool tensor, negligible next to the pass); the attention
function ignores it and applies each span's mask.

`supports_ragged(model)` says whether a model can take this path: its attention must go
through the interface (`_supports_attention_backend`) and be plain causal softmax attention
(no sliding window, logit soft-capping or attention sinks, which the per-session SDPA here
does not apply). Other models are served one session per forward with their own attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

NAME = "sdcp_ragged"


@dataclass(frozen=True)
class Span:
    lo: int  # packed rows lo:hi are this session's new tokens
    hi: int
    cache: object  # the session's transformers DynamicCache (batch 1), its layers created
    mask: torch.Tensor | None  # bool [1, 1, hi - lo, past + hi - lo]; None: one token, or
    # no past (plain causal attention, which SDPA computes without a mask)


@dataclass(frozen=True)
class RaggedLayout:
    spans: list[Span]


def causal_offset_mask(past: int, new: int, device) -> torch.Tensor | None:
    """[1, 1, new, past + new] bool: new query i sees keys 0..past+i. None when new == 1 (it
    sees every key) or past == 0 (SDPA's own is_causal)."""
    if new == 1 or past == 0:
        return None
    keys = torch.arange(past + new, device=device)
    return (keys[None, :] <= (past + torch.arange(new, device=device))[:, None])[None, None]


def ragged_attention(module, query, key, value, attention_mask, *, sdcp_ragged=None, **kwargs):
    """query [1, H, T, Dh], key/value [1, Hkv, T, Dh] for the packed new tokens (RoPE applied)
    -> (output [1, T, H, Dh], None)."""
    if sdcp_ragged is None:  # not our call: behave as transformers' SDPA attention
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    # torch's SDPA directly, grouped-query heads without copies (enable_gqa): per session
    # it costs 35 us for one query and 103 us for six over 200 keys, against 47 and 177 us
    # through transformers' wrapper, which repeats K/V whenever there is a mask
    gqa = query.shape[1] != key.shape[1]
    scale = kwargs.get("scaling")
    outs = []
    for span in sdcp_ragged.spans:
        lo, hi = span.lo, span.hi
        layer = span.cache.layers[module.layer_idx]
        keys, values = layer.update(key[:, :, lo:hi], value[:, :, lo:hi])  # the layer's cat
        outs.append(F.scaled_dot_product_attention(
            query[:, :, lo:hi], keys, values, attn_mask=span.mask,
            is_causal=span.mask is None and hi - lo > 1, scale=scale, enable_gqa=gqa,
        ))  # [1, H, hi - lo, Dh]
    return torch.cat(outs, dim=2).transpose(1, 2), None


def register() -> None:
    """Register the attention function, and SDPA's mask builder under the same name, so
    that an ordinary call of the model (no layout) behaves exactly as "sdpa"."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, ragged_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def supports_ragged(model) -> bool:
    if not getattr(model, "_supports_attention_backend", False):
        return False
    config = model.config.get_text_config()
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:  # e.g. Qwen2 keeps a sliding_window value it does not use
        full = all(t == "full_attention" for t in layer_types)
    else:
        full = not getattr(config, "sliding_window", None)
    return full and not getattr(config, "attn_logit_softcapping", None)
