"""Tiny GGUF files for tests, written with the `gguf` package as llama.cpp's converter writes them.

A random-weight Llama (the tiny tokenizer, ChatML template) goes into one GGUF with its 2-D weights
in a chosen block type (norms stay F32, as llama.cpp keeps them) and q/k rows permuted for llama.cpp's
RoPE layout, so `transformers` reads it back (`gguf_file=`, dequantizing) as the reference model.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tandem.tiny_model import TINY_EOS_TOKEN_IDS, TINY_VOCAB_SIZE, build_tiny_tokenizer

# HF parameter name inside a layer -> llama.cpp's tensor name inside `blk.N`.
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def tiny_gguf_llama(seed: int = 0, tie_word_embeddings: bool = False) -> LlamaForCausalLM:
    """The random Llama the tiny GGUFs hold: head_dim = hidden / heads, as llama.cpp's llama assumes."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.08,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=list(TINY_EOS_TOKEN_IDS),
        bos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(config).eval()


def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (`LlamaModel.permute`): each head's rotary halves interleaved."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def write_tiny_gguf(
    path: Path, weight_type: GGMLQuantizationType, model: LlamaForCausalLM | None = None
) -> LlamaForCausalLM:
    """Write `model` (default `tiny_gguf_llama()`) to `path` with 2-D weights in `weight_type`."""
    model = model or tiny_gguf_llama()
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    _add_tokenizer(writer, path.parent / f"{path.stem}-tokenizer")
    for name, tensor in _gguf_tensors(model):
        array = tensor.detach().float().numpy()
        if array.ndim == 1 or weight_type == GGMLQuantizationType.F32:
            writer.add_tensor(name, array)
        elif weight_type == GGMLQuantizationType.F16:
            writer.add_tensor(name, array.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(array, weight_type), raw_dtype=weight_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def _gguf_tensors(model: LlamaForCausalLM):
    cfg = model.config
    state = model.state_dict()
    yield "token_embd.weight", state["model.embed_tokens.weight"]
    for index in range(cfg.num_hidden_layers):
        for hf_part, gguf_part in _LAYER_NAMES.items():
            weight = state[f"model.layers.{index}.{hf_part}.weight"]
            if gguf_part in ("attn_q", "attn_k"):
                heads = cfg.num_attention_heads if gguf_part == "attn_q" else cfg.num_key_value_heads
                weight = torch.from_numpy(llama_cpp_permute(weight.numpy(), heads))
            yield f"blk.{index}.{gguf_part}.weight", weight
    yield "output_norm.weight", state["model.norm.weight"]
    if not cfg.tie_word_embeddings:
        yield "output.weight", state["lm_head.weight"]


def _add_tokenizer(writer: gguf.GGUFWriter, scratch: Path) -> None:
    """The tiny byte-level BPE as llama.cpp's "gpt2" tokenizer: tokens, types, merges, ids, template."""
    hf = AutoTokenizer.from_pretrained(build_tiny_tokenizer(scratch))
    state = json.loads(hf.backend_tokenizer.to_str())
    vocab = sorted(state["model"]["vocab"].items(), key=lambda item: item[1])
    special = {token.content: token_id for token_id, token in hf.added_tokens_decoder.items()}
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in state["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types(
        [gguf.TokenType.CONTROL if token in special else gguf.TokenType.NORMAL for token, _ in vocab]
    )
    writer.add_token_merges(merges)
    writer.add_eos_token_id(hf.eos_token_id)
    writer.add_pad_token_id(hf.pad_token_id)
    writer.add_chat_template(hf.chat_template)
