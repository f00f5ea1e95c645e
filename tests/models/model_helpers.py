"""Helpers shared by the model tests (a unique module name: tests run in rootdir-prepend mode)."""

from __future__ import annotations

import torch

from sdcp_fast.models.gpt import ModelConfig, Transformer

SMALL = ModelConfig(n_layer=2, n_head=2, d_model=32, d_ff=64, max_seq_len=128)


def random_model(cfg: ModelConfig = SMALL, seed: int = 0) -> Transformer:
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    with torch.no_grad():  # larger weights: peaked, position-sensitive logits, so bugs show
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8)
    return model.eval()


def random_llama(vocab: int, d_model: int, d_ff: int, layers: int, heads: int, kv_heads: int, *,
                 tied: bool = True, theta: float = 10000.0, context: int = 256, seed: int = 0):
    """A small random transformers LlamaForCausalLM with larger weights than its initialiser's
    (peaked, position-sensitive logits, so bugs show) and norm weights away from 1."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=d_model, intermediate_size=d_ff, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, rope_theta=theta,
        rms_norm_eps=1e-5, max_position_embeddings=context, tie_word_embeddings=tied,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_(4)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def permute_for_gguf(w: torch.Tensor, heads: int):
    """convert_hf_to_gguf's q/k permutation: each head's halves become adjacent pairs."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
        .numpy()
    )


def write_llama_gguf(model, path) -> None:
    """A transformers LlamaForCausalLM written as a GGUF of fp32 tensors (gguf package), named
    and laid out as llama.cpp's converter writes them (an untied model gets output.weight)."""
    import gguf
    import numpy as np

    c = model.config
    H, KV = c.num_attention_heads, c.num_key_value_heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(float(model.model.rotary_emb.config.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"].numpy())
    w.add_tensor("output_norm.weight", sd["model.norm.weight"].numpy())
    if not c.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"].numpy())
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for name, value in {
            "attn_norm": sd[p + "input_layernorm.weight"].numpy(),
            "attn_q": permute_for_gguf(sd[p + "self_attn.q_proj.weight"], H),
            "attn_k": permute_for_gguf(sd[p + "self_attn.k_proj.weight"], KV),
            "attn_v": sd[p + "self_attn.v_proj.weight"].numpy(),
            "attn_output": sd[p + "self_attn.o_proj.weight"].numpy(),
            "ffn_norm": sd[p + "post_attention_layernorm.weight"].numpy(),
            "ffn_gate": sd[p + "mlp.gate_proj.weight"].numpy(),
            "ffn_up": sd[p + "mlp.up_proj.weight"].numpy(),
            "ffn_down": sd[p + "mlp.down_proj.weight"].numpy(),
        }.items():
            w.add_tensor(f"blk.{i}.{name}.weight", np.ascontiguousarray(value))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
