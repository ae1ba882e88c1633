"""A GGUF file read as a checkpoint: config and weights from the file itself, each tensor in its own type.

Why: the models people run on a CPU ship as GGUF (llama.cpp's format), and dequantizing one to fp32
first (what `transformers` does with `gguf_file=`) makes an 8 GiB Q8_0 model a 30 GiB one. Here the file
is memory-mapped (`gguf.GGUFReader`: each tensor a numpy view of its blocks) and streamed as a
`Checkpoint` is: F32/F16/BF16 tensors are handed out for the model to convert into its dtype, block
types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) as their raw blocks
(`kernels.gguf_blocks.BlockWeight`), which a linear layer or the embedding keeps as stored, viewing the
file. Other types (the I-quants, Q2_K, Q3_K) are refused when the file is opened.

`transformers` names the config fields (`AutoConfig.from_pretrained(..., gguf_file=)` reads metadata
only) and builds the tokenizer; its tensor loading, which dequantizes, is never used. Tensor names follow
llama.cpp's for the llama family (llama, mistral, qwen2) and Gemma 3 (its four norms a layer and per-head
q/k norms). Two things llama.cpp's converter changed are undone as transformers' loader undoes them: the
q/k rows it permuted for its RoPE (llama, mistral) are put back in Hugging Face order, and the 1 it added
to Gemma's RMSNorm weights (its kernel multiplies by the weight, Gemma's by `1 + weight`) is subtracted.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from base.errors import ModelNotFoundError
from engine import mapped_pages
from engine.checkpoint_stream import StoredTensor
from engine.gguf_metadata import gguf_field, gguf_reader
from engine.load_progress import LoadProgress
from engine.model_cache_check import check_finite
from kernels.gguf_blocks import BLOCK_TYPES, BlockWeight

if TYPE_CHECKING:
    from gguf import ReaderTensor
    from transformers import PretrainedConfig

# Block types read here, by GGML's name for them; the rest are refused with `UnsupportedWeightTypeError`.
SUPPORTED_TYPES = ("F32", "F16", "BF16", *BLOCK_TYPES)
# Architectures whose tensors are named as llama's; "llama" and "mistral" have their q/k rows permuted.
LLAMA_FAMILY = ("llama", "mistral", "qwen2")
ARCHITECTURES = (*LLAMA_FAMILY, "gemma3")
_PERMUTED_ARCHITECTURES = ("llama", "mistral")
# Architectures whose RMSNorm weights llama.cpp's converter stored with 1 added.
_NORMS_PLUS_ONE = ("gemma3",)

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma 3's layer: norms on the attention's and the MLP's outputs too, and over each q/k head.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_ARCHITECTURE_LAYER_NAMES = {"gemma3": _GEMMA3_LAYER_NAMES}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_TENSOR = re.compile(r"(\w+)\.(weight|bias)")


class UnsupportedWeightTypeError(ModelNotFoundError):
    """The GGUF holds tensors in a type tandem does not read (the I-quants, Q2_K, Q3_K)."""


@dataclass(frozen=True)
class GgufStoredTensor(StoredTensor):
    """A GGUF tensor's type and shape; its bytes come from the block type, not a per-element size."""

    stored_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return self.stored_bytes


class GgufCheckpoint:
    """A GGUF's config and tensor table, its weights left in the mapped file for `tensors` to stream.

    Has what `engine.checkpoint_stream.Checkpoint` has (`path`, `config`, `names`, `stored`, `nbytes`,
    `tensors`), so the engine and the load plan take either.
    """

    def __init__(self, path: Path, config: PretrainedConfig) -> None:
        self.path = Path(path)
        self.config = config
        self._reader = gguf_reader(self.path)
        self.architecture = gguf_field(self._reader, "general.architecture")
        if self.architecture not in ARCHITECTURES:
            raise ModelNotFoundError(
                f"{self.path} is a GGUF of architecture {self.architecture!r}; tandem reads "
                f"{', '.join(ARCHITECTURES)} GGUFs (`tandem fetch-model` converts the models it knows)"
            )
        unsupported = sorted({t.tensor_type.name for t in self._reader.tensors} - set(SUPPORTED_TYPES))
        if unsupported:
            raise UnsupportedWeightTypeError(
                f"{self.path} holds {', '.join(unsupported)} tensors: tandem reads GGUF weights in "
                f"{', '.join(SUPPORTED_TYPES)} (`tandem fetch-model` converts the models it knows)"
            )
        self._hf_names = {t.name: hf_name(t.name, self.architecture) for t in self._reader.tensors}

    @property
    def weight_types(self) -> dict[str, int]:
        """How many tensors the file holds of each block type."""
        counts: dict[str, int] = {}
        for tensor in self._reader.tensors:
            counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
        return counts

    @property
    def names(self) -> list[str]:
        """Every tensor's Hugging Face name, in file order (a tied LM head is absent, as on disk)."""
        return list(self._hf_names.values())

    @cached_property
    def stored(self) -> list[StoredTensor]:
        """Every tensor's block type, shape (HF order: rows first) and bytes on disk."""
        return [
            GgufStoredTensor(
                self._hf_names[t.name], t.tensor_type.name, _rows_first(t), stored_bytes=int(t.n_bytes)
            )
            for t in self._reader.tensors
        ]

    @property
    def nbytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.stored)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor | BlockWeight]]:
        """Each tensor as stored under its Hugging Face name: a torch view of the file for F32/F16/BF16
        (released once the model asked for the next), a `BlockWeight` over the file's blocks for a block
        type (kept: the layer computes on it). Raises NonFiniteWeightsError at a NaN or infinite float tensor.
        """
        progress = LoadProgress(f"loading {self.path.name}", len(self._reader.tensors), self.nbytes)
        for stored in self._reader.tensors:
            name = self._hf_names[stored.name]
            tensor = self._tensor(stored)
            if isinstance(tensor, torch.Tensor):
                check_finite(name, tensor, self.path)
            yield name, tensor
            progress.advance(1, int(stored.n_bytes))
            if isinstance(tensor, torch.Tensor):
                mapped_pages.release(tensor, self.path)
            del tensor
        progress.finish("gguf checkpoint streamed", path=str(self.path), types=self.weight_types)

    def _tensor(self, stored: ReaderTensor) -> torch.Tensor | BlockWeight:
        """One tensor as a view of the file: its own float dtype, or its blocks, HF row order."""
        kind = stored.tensor_type.name
        with warnings.catch_warnings():
            # The mapping is read-only, and so are the tensors that view it: nothing writes to them.
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(stored.data)
        rows_first = _rows_first(stored)
        order = self._row_order(stored.name, rows_first[0])
        if kind in BLOCK_TYPES:
            return BlockWeight(data, rows_first[-1], kind, order)
        tensor = data.view(torch.bfloat16).reshape(rows_first) if kind == "BF16" else data.reshape(rows_first)
        if self.architecture in _NORMS_PLUS_ONE and stored.name.endswith("norm.weight"):
            # A new tensor of one norm's size, in the file's float type as transformers computes it.
            return tensor - 1
        return tensor if order is None else tensor[order]

    def _row_order(self, gguf_name: str, rows: int) -> torch.Tensor | None:
        """The HF row order of a q/k weight llama.cpp permuted (None for every other tensor)."""
        if self.architecture not in _PERMUTED_ARCHITECTURES:
            return None
        match = _LAYER_TENSOR.fullmatch(gguf_name)
        if match is None or match.group(2) not in ("attn_q", "attn_k"):
            return None
        config = self.config
        heads = config.num_attention_heads if match.group(2) == "attn_q" else config.num_key_value_heads
        return unpermute_order(rows, heads)


def unpermute_order(rows: int, heads: int) -> torch.Tensor:
    """Indices that put llama.cpp's permuted q/k rows back in HF order (transformers'
    `_reverse_permute_weights` applied to the row numbers)."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)


def hf_name(gguf_name: str, architecture: str = "llama") -> str:
    """The Hugging Face parameter name of a GGUF tensor of `architecture`; ModelNotFoundError for one
    with no place in it."""
    layer_names = _ARCHITECTURE_LAYER_NAMES.get(architecture, _LAYER_NAMES)
    layer = _LAYER_TENSOR.fullmatch(gguf_name)
    if layer is not None and layer.group(2) in layer_names:
        return f"model.layers.{layer.group(1)}.{layer_names[layer.group(2)]}.{layer.group(3)}"
    single = _GLOBAL_TENSOR.fullmatch(gguf_name)
    if single is not None and single.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[single.group(1)]}.{single.group(2)}"
    raise ModelNotFoundError(f"GGUF tensor {gguf_name!r} has no place in a {architecture} model")


def _rows_first(tensor: ReaderTensor) -> tuple[int, ...]:
    """A GGUF tensor's shape as torch writes it (GGUF lists the fastest-running dimension first)."""
    return tuple(int(n) for n in reversed(tensor.shape))
