"""Tiny GGUF files for tests, written with the `gguf` package as llama.cpp's converter writes them.

A random-weight Llama (the tiny tokenizer, ChatML template) goes into one GGUF with its 2-D weights
in a chosen block type (norms stay F32, as llama.cpp keeps them) and q/k rows permuted for llama.cpp's
RoPE layout, so `transformers` reads it back (`gguf_file=`, dequantizing) as the reference model. Types
the `gguf` package cannot quantize to (the K types, Q2_K) are written as random blocks of the weights'
magnitude instead (`random_blocks`): the reference reads whatever the file holds.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from kernels.gguf_blocks import dequantize
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


# Types `gguf.quants.quantize` writes; the others are built by hand (`random_blocks`).
QUANTIZABLE = {GGMLQuantizationType[kind] for kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")}
# Byte offsets of each block type's fp16 fields (scale, and minimum where there is one).
HALF_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def tiny_gguf_llama(
    seed: int = 0, tie_word_embeddings: bool = False, hidden_size: int = 128, intermediate_size: int = 96
) -> LlamaForCausalLM:
    """The random Llama the tiny GGUFs hold: head_dim = hidden / heads, as llama.cpp's llama assumes (the
    K types need both sizes a multiple of 256)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
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
    path: Path,
    weight_type: GGMLQuantizationType,
    model: LlamaForCausalLM | None = None,
    overrides: Mapping[str, GGMLQuantizationType] | None = None,
) -> LlamaForCausalLM:
    """Write `model` (default `tiny_gguf_llama()`) to `path` with 2-D weights in `weight_type`, or in
    `overrides[part]` for the tensors named `part` (`attn_v`, `token_embd`: a llama.cpp `_M` mix)."""
    overrides = overrides or {}
    default_type = weight_type
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
        part = name.split(".")[-2]
        weight_type = overrides.get(part, default_type)
        if array.ndim == 1 or weight_type == GGMLQuantizationType.F32:
            writer.add_tensor(name, array)
        elif weight_type == GGMLQuantizationType.F16:
            writer.add_tensor(name, array.astype(np.float16))
        elif weight_type in QUANTIZABLE or weight_type == GGMLQuantizationType.BF16:
            writer.add_tensor(name, gguf.quants.quantize(array, weight_type), raw_dtype=weight_type)
        else:
            blocks = random_blocks(
                weight_type.name, *array.shape, float(array.std()), seed=zlib.crc32(name.encode())
            )
            writer.add_tensor(name, blocks, raw_dtype=weight_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def random_blocks(kind: str, rows: int, cols: int, std: float, seed: int) -> np.ndarray:
    """`rows x cols` weights of block type `kind` as random bytes whose fp16 fields are one value, chosen
    so the weights' standard deviation is about `std` (Q2_K, which tandem refuses, stays unscaled)."""
    weights, nbytes = gguf.GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // weights, nbytes), dtype=np.uint8)
    for start in HALF_FIELDS[kind]:
        raw[..., start : start + 2] = np.array([1.0], np.float16).view(np.uint8)
    raw = raw.reshape(rows, -1)
    if kind == "Q2_K":
        return raw
    unit = dequantize(torch.from_numpy(raw), kind, cols).std().item()
    grouped = raw.reshape(rows, cols // weights, nbytes)
    for start in HALF_FIELDS[kind]:
        grouped[..., start : start + 2] = np.array([std / unit], np.float16).view(np.uint8)
    return raw


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
