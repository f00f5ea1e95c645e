"""Tiny random Llama models for the Hugging Face backend tests, saved as a model directory or
written as a GGUF file with the `gguf` package (no downloads; a module name unique across
the test tree, as tests run in rootdir-prepend mode)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]
# a byte-level BPE vocabulary: specials, letters, the space marker and space+letter merges
TOKENS = SPECIALS + LETTERS + ["Ġ"] + ["Ġ" + c for c in LETTERS[:18]]
MERGES = ["Ġ " + c for c in LETTERS[:18]]
VOCAB = len(TOKENS)  # 48


def tiny_llama(seed: int = 0, *, vocab: int = VOCAB, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger weights: peaked, position-sensitive logits, so bugs show
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3 if "embed" in name or "lm_head" in name else 0.15)
    return model


def bpe_tokenizer():
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(TOKENS)}
    tok = tokenizers.Tokenizer(
        tokenizers.models.BPE(vocab, [tuple(m.split(" ")) for m in MERGES])
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIALS[1], eos_token=SPECIALS[2],
        unk_token=SPECIALS[0], pad_token=SPECIALS[0],
    )


def save_model_dir(model, path: Path) -> Path:
    model.save_pretrained(path)
    bpe_tokenizer().save_pretrained(path)
    return path


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row order (its convert script's permute; transformers undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape
    )


def write_gguf(model, path: Path) -> Path:
    """`model` (a tiny_llama) as a llama-architecture GGUF file with its BPE tokenizer."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("sdcp tiny test llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(0)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(c.num_hidden_layers):
        for hf_name, gg_name in names.items():
            t = sd[f"model.layers.{i}.{hf_name}.weight"]
            if gg_name == "attn_q":
                t = _llama_cpp_permute(t, c.num_attention_heads)
            elif gg_name == "attn_k":
                t = _llama_cpp_permute(t, c.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{gg_name}.weight", np.ascontiguousarray(t))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
