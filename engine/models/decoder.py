"""The decoder skeleton every family shares, over the paged KV cache: attention, gated MLP, RMSNorm,
rotary embeddings, and the `CausalLM` that stacks them and loads a Hugging Face checkpoint.

One forward takes a flat batch of tokens from many sequences at different positions — prefill
chunks and single decode tokens mixed — and the `AttentionMetadata` that says where each
sequence's context lives in the cache. Projections are fused (qkv, gate_up) so a step does
fewer, larger matmuls; `load_weights` maps Hugging Face parameter names onto them.

The base classes are the Llama layer (Llama 2/3, SmolLM2, Mistral, Qwen2). A family (one module
beside this one, chosen by `engine.families.FAMILIES`) subclasses `CausalLM` and overrides only the
`make_*` pieces that differ: its norm, its layer's norm arrangement, its attention's scale or
per-head q/k norm, its MLP (a mixture of experts swaps in here), its embedding scale, its checkpoint
names.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import ModuleType
from typing import Any, ClassVar

import torch
from torch import nn

from engine.config import ModelConfig, rope_parameter_sets
from engine.kv_cache import KVCache
from engine.sampler import greedy_argmax
from kernels.backend import AttentionBackend
from kernels.block_embedding import BlockEmbedding
from kernels.block_linear import BlockLinear
from kernels.cpu_decode_stack import ACTIVATIONS, CpuDecodeStack, LayerNorms, takes_linear
from kernels.gguf_blocks import BlockWeight
from kernels.metadata import AttentionMetadata
from kernels.w8a8_linear import W8A8Linear

CosSin = tuple[torch.Tensor, torch.Tensor]

# Bytes of fp32 a quantized layer is handed at once while loading (`row_blocks`): the quantizer makes a
# few temporaries of its input's size, which for a whole 262k-row embedding would be GiBs.
ROW_BLOCK_BYTES = 16 << 20


def row_blocks(tensor: torch.Tensor, dtype: torch.dtype, dim: int = 0) -> Iterator[tuple[int, torch.Tensor]]:
    """`(first row, rows)` of `tensor` along `dim`, a block of about `ROW_BLOCK_BYTES` (in fp32) at a time,
    each converted to `dtype`: what a loader that quantizes rows independently takes, one block at a time."""
    rows = tensor.shape[dim]
    per_row = max(1, tensor.numel() // max(rows, 1)) * 4
    step = max(1, ROW_BLOCK_BYTES // per_row)
    for start in range(0, rows, step):
        yield start, tensor.narrow(dim, start, min(step, rows - start)).to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the positions of a step, computed the way Hugging Face does.

    The inverse frequencies come from `transformers`' own RoPE initialisers, so every variant its
    config can name (default, llama3, linear, yarn, longrope's short factors) gives the same rotation
    here as there. `layer_type` picks one set of a config whose RoPE differs per layer type (Gemma 3:
    another base for its sliding layers). A `partial_rotary_factor` below 1 rotates only the first
    part of each head (the tables are that narrow; `Attention` leaves the rest as it is).
    """

    def __init__(self, config: ModelConfig, params: Mapping[str, Any], layer_type: str | None) -> None:
        super().__init__()
        rope_type = params.get("rope_type", params.get("type", "default"))
        with torch.device("cpu"):
            if rope_type == "default":
                theta = params.get("rope_theta", getattr(config.hf_config, "rope_theta", 10000.0))
                dim = int(config.head_dim * params.get("partial_rotary_factor", 1.0))
                exponents = torch.arange(0, dim, 2, dtype=torch.float) / dim
                inv_freq, scaling = 1.0 / (theta**exponents), 1.0
            else:
                from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

                init = ROPE_INIT_FUNCTIONS[rope_type]
                inv_freq, scaling = init(config.hf_config, torch.device("cpu"), layer_type=layer_type)
        # A plain attribute, not a buffer: it must stay fp32 when the model is cast to bf16.
        self.inv_freq = inv_freq.float()
        self.scaling = float(scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> CosSin:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def rotate(heads: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """`heads [T, n, head_dim]` times the fp32 orthonormal `rotation`, in fp32: a half-precision copy of
    the matrix would be orthonormal only to 2**-9, and that error would land on every score."""
    return torch.matmul(heads.float(), rotation).to(heads.dtype)


class RMSNorm(nn.Module):
    """Llama's RMSNorm (`weight * normed`), with the residual add fused in front."""

    def __init__(self, size: int, eps: float, backend: AttentionBackend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.backend = backend

    def kernel_weight(self) -> torch.Tensor:
        """The factor the fused RMSNorm kernel multiplies the normed values by (the decode stack's too)."""
        return self.weight.detach()

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.backend.rms_norm(x, self.weight, self.eps, residual)


NormFactory = Callable[[int], nn.Module]


class Attention(nn.Module):
    """Self-attention of one layer over its paged cache, with its window and its KV group's metadata.

    `qk_norm` (Qwen3, Gemma 3) builds a norm over one head's features, applied to every query and key
    head before RoPE; `scale` replaces 1/sqrt(head_dim) (Gemma's `query_pre_attn_scalar`).
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        backend: AttentionBackend,
        scale: float | None = None,
        qk_norm: NormFactory | None = None,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.backend = backend
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5 if scale is None else scale
        self.window = config.layer_windows[layer_index] if config.layer_windows else None
        self.kv_group = config.kv_layout.group_of_layer[layer_index]
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = None if qk_norm is None else qk_norm(self.head_dim)
        self.k_norm = None if qk_norm is None else qk_norm(self.head_dim)

    def forward(self, hidden: torch.Tensor, cos_sin: CosSin, kv_cache: KVCache, meta: AttentionMetadata):
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q, _ = self.q_norm(q.reshape(-1, self.head_dim))
            k, _ = self.k_norm(k.reshape(-1, self.head_dim))
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = self._rope(q, k, *cos_sin)
        if kv_cache.rotation is not None:
            q, k = rotate(q, kv_cache.rotation), rotate(k, kv_cache.rotation)
        layer_meta = meta.for_group(self.kv_group)
        k_cache, v_cache = kv_cache.k[self.layer_index], kv_cache.v[self.layer_index]
        k_scales, v_scales = kv_cache.scales(self.layer_index)
        self.backend.write_kv_cache(k, v, k_cache, v_cache, layer_meta.slot_mapping, k_scales, v_scales)
        out = self.backend.attention(
            q, k_cache, v_cache, layer_meta, self.scale, k_scales, v_scales, window=self.window
        )
        return self.o_proj(out.reshape(-1, self.q_size))

    def _rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """RoPE over all of each head, or over its first `cos.shape[-1]` features (partial rotary)."""
        width = cos.shape[-1]
        if width == self.head_dim:
            return self.backend.apply_rope(q, k, cos, sin)
        q_rot, k_rot = self.backend.apply_rope(
            q[..., :width].contiguous(), k[..., :width].contiguous(), cos, sin
        )
        return torch.cat((q_rot, q[..., width:]), dim=-1), torch.cat((k_rot, k[..., width:]), dim=-1)


# The gated activations `ModelConfig.hidden_act` may name: `act(gate) * up`, by torch's GELU variant
# (SiLU runs on the backend's fused kernel).
GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


class GatedMLP(nn.Module):
    """`down(act(gate(x)) * up(x))` with gate and up fused into one projection."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.backend = backend
        self.activation = config.hidden_act
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(hidden)
        if self.activation == "silu":
            return self.down_proj(self.backend.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        approximate = GELU_APPROXIMATIONS[self.activation]
        return self.down_proj(nn.functional.gelu(gate, approximate=approximate) * up)


# `DecoderLayer`'s norms as the C++ decode stack reads them: the input norm, and the post-attention norm that
# adds the attention's output to the residual stream and norms the MLP's input.
PRE_NORMS = LayerNorms(input="input_layernorm", mlp="post_attention_layernorm")


class DecoderLayer(nn.Module):
    """Pre-norm layer: `h += attn(norm(h))`, then `h += mlp(norm(h))`, the residual add fused into
    the next norm (each returns the normed input and the running residual)."""

    def __init__(self, input_norm: nn.Module, attention: nn.Module, post_norm: nn.Module, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = input_norm
        self.self_attn = attention
        self.post_attention_layernorm = post_norm
        self.mlp = mlp

    def forward(self, hidden, residual, cos_sin: CosSin, kv_cache: KVCache, meta: AttentionMetadata):
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos_sin, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class CausalLM(nn.Module):
    """Decoder stack plus LM head; `forward` returns hidden states, `compute_logits` the fp32 logits."""

    # Checkpoint projections this model fuses: Hugging Face name part -> (our fused part, shard index).
    stacked_params: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # How the C++ decode stack (`kernels.cpu_decode_stack`) reads this family's decoder layers: which norm
    # module plays each part. The rest it reads from the layers and the config (q/k norms, activation, scale,
    # partial rotary, windows, RoPE tables, KV groups). None: a family whose layers it does not compute (a
    # mixture of experts keeps the per-op path).
    stack_norms: ClassVar[LayerNorms | None] = None

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        # An explicit (uninitialised) weight skips nn.Embedding's random init: the weights are loaded
        # anyway, and on the meta device that init imports torch._dynamo and with it Triton, whose
        # native objects then leak noisily at exit on a CPU machine that never uses them.
        embedding = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=embedding)
        rope_sets = rope_parameter_sets(config.hf_config)
        # One table per distinct RoPE (key None: the whole model's), and the key each layer reads.
        self.rotaries = {key: RotaryEmbedding(config, params, key) for key, params in rope_sets.items()}
        layer_types = getattr(config.hf_config, "layer_types", None)
        self.layer_rope = tuple(
            layer_types[i] if None not in rope_sets else None for i in range(config.num_layers)
        )
        self.layers = nn.ModuleList(self.make_layer(i) for i in range(config.num_layers))
        self.norm = self.make_norm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Handed over by the platform (`kernels.platform.Platform.specialize`) where the device has them:
        # the layers of a decode-only step in one call, and each row's greedy token straight from the
        # hidden states. None: the layer loop below and the argmax of the logits, which they match.
        self.decode_stack: CpuDecodeStack | None = None
        self.greedy_head: Callable[[torch.Tensor], torch.Tensor] | None = None

    # The pieces a family replaces.

    def make_norm(self, size: int) -> nn.Module:
        return RMSNorm(size, self.config.rms_norm_eps, self.backend)

    def make_attention(self, layer_index: int) -> nn.Module:
        return Attention(self.config, layer_index, self.backend)

    def make_mlp(self, layer_index: int) -> nn.Module:
        return GatedMLP(self.config, self.backend)

    def make_layer(self, layer_index: int) -> nn.Module:
        size = self.config.hidden_size
        attention, mlp = self.make_attention(layer_index), self.make_mlp(layer_index)
        return DecoderLayer(self.make_norm(size), attention, self.make_norm(size), mlp)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def checkpoint_name(self, hf_name: str) -> str | None:
        """Our parameter name for a checkpoint tensor (before fusing), or None for one that is skipped."""
        name = hf_name.removeprefix("model.")
        if "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
            return None
        return name

    @property
    def fits_decode_stack(self) -> bool:
        """Whether the C++ decode stack computes this model's layers exactly: a family that declares its
        `stack_norms`, with an activation the stack has and linears it computes (fp32, int8 or GGUF Q8_0)."""
        activations = all(getattr(layer.mlp, "activation", None) in ACTIVATIONS for layer in self.layers)
        linears = all(takes_linear(module) for module in self.layers.modules())
        return self.stack_norms is not None and activations and linears

    def build_decode_stack(self, extension: ModuleType) -> CpuDecodeStack:
        """The C++ decode stack over this model's layers (where `fits_decode_stack`): each layer's window,
        RoPE table and the features that table rotates, as the layer loop gives them."""
        dims = {key: 2 * rotary.inv_freq.numel() for key, rotary in self.rotaries.items()}
        return CpuDecodeStack(
            self.layers,
            extension,
            self.stack_norms,
            self.config.layer_windows,
            self.layer_rope,
            [dims[key] for key in self.layer_rope],
        )

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed(input_ids)
        tables = {key: rotary(positions, hidden.dtype) for key, rotary in self.rotaries.items()}
        if self.decode_stack is not None and self.decode_stack.accepts(hidden, meta):
            hidden, residual = self.decode_stack(hidden, tables, kv_cache, meta)
        else:
            residual = None
            for layer, rope in zip(self.layers, self.layer_rope, strict=True):
                hidden, residual = layer(hidden, residual, tables[rope], kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's argmax token; a greedy head finds it without writing the logits out."""
        if self.greedy_head is not None:
            return self.greedy_head(hidden)
        return greedy_argmax(self.compute_logits(hidden))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the engine cast the model to (its final norm's: norms are never quantized)."""
        return self.norm.weight.dtype

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face parameters in as they come, concatenating the `stacked_params` into our
        fused layers; raises KeyError for a tensor with no place here, or for parameters never given.

        `weights` may be a stream (`engine.checkpoint_stream`): each tensor is used once, as stored, and
        never kept, so a load holds the model and one checkpoint tensor. A full-precision parameter
        converts as it copies; a quantized layer (`engine.quantization`) has no full-precision weight to
        copy into, and its `load_weight_rows(offset, tensor)` quantizes the tensor a block of rows at a
        time (`row_blocks`), so the quantizer's fp32 temporaries stay small whatever the tensor's size.
        A GGUF's block-quantized weight (`kernels.gguf_blocks.BlockWeight`, any block type) bound for a
        full-precision linear or the embedding turns it into a `BlockLinear` or `BlockEmbedding` holding
        the blocks as stored; anywhere else it is dequantized.
        """
        params = dict(self.named_parameters())
        row_loaders = self._weight_row_loaders()
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = self.checkpoint_name(hf_name)
            if name is not None:
                loaded.update(self._load_tensor(hf_name, name, tensor, params, row_loaders))
        missing = self._expected_shards() - loaded
        missing.update(
            f"{n}.weight" for n, m in self.named_modules() if isinstance(m, BlockLinear) and m.missing_rows()
        )
        if missing:
            raise KeyError(f"checkpoint lacks parameters: {sorted(missing)[:5]}")

    def _load_tensor(
        self,
        hf_name: str,
        name: str,
        tensor: torch.Tensor,
        params: Mapping[str, nn.Parameter],
        row_loaders: Mapping[str, Callable[[int, torch.Tensor], None]],
    ) -> list[str]:
        """Put one checkpoint tensor (our name `name`) in its place; return the `_expected_shards` keys
        it filled."""
        name, shard = self.fused_name(name)
        offset = 0 if shard is None else self._shard_offset(name, shard)
        if isinstance(tensor, BlockWeight):
            if self._place_blocks(name, offset, tensor):
                return [f"{name}#{shard}"]
            tensor = tensor.dequantize()
        elif isinstance(self._weight_owner(name), BlockLinear):
            raise ValueError(
                f"checkpoint tensor {hf_name!r} is not block-quantized but shares a layer with ones that are"
            )
        if name in row_loaders:
            for start, rows in row_blocks(tensor, self.dtype):
                row_loaders[name](offset + start, rows)
        elif name not in params:
            raise KeyError(f"checkpoint parameter {hf_name!r} has no place in the model")
        elif shard is None:
            params[name].data.copy_(tensor)
        else:
            params[name].data.narrow(0, offset, tensor.shape[0]).copy_(tensor)
        return [f"{name}#{shard}"]

    def fused_name(self, name: str) -> tuple[str, int | None]:
        """Our parameter name for the (unfused) parameter `name`, and its shard in the fused one (None:
        not fused)."""
        for hf_part, (ours, index) in self.stacked_params.items():
            if f".{hf_part}." in name:
                return name.replace(f".{hf_part}.", f".{ours}."), index
        return name, None

    def block_owner(self, name: str) -> nn.Module | None:
        """The linear or embedding that keeps a GGUF block-quantized weight bound for our parameter `name`
        as stored, or None where it is dequantized instead (a module already quantized another way). A
        tied LM head has no weight of its own: it reads the embedding's blocks.

        A `W8A8Linear` (`--quantization w8a8_int8`) keeps them too, as a w8a8 `BlockLinear`: Q8_0 blocks
        are already 8-bit weights in llama.cpp's scheme, so they stay as stored (shared pages, no second
        rounding) and the activations are quantized per block, where requantizing the dequantized rows
        to one scale per row would round every weight again. Blocks of the other types in such a layer
        stay as stored too and run exactly (a fused layer may mix types, and one layer holds one kind of
        weight: its blocks or int8 rows)."""
        module = self._weight_owner(name)
        tied = module is self.lm_head and self.config.tie_word_embeddings
        kept = type(module) in (nn.Linear, nn.Embedding, BlockLinear) or isinstance(module, W8A8Linear)
        if tied or not kept:
            return None
        return module

    def _place_blocks(self, name: str, offset: int, weight: BlockWeight) -> bool:
        """Give `weight` to the module whose weight is `name`, as its rows `offset..` for a linear, first
        making it a `BlockLinear` (w8a8 for a `W8A8Linear`) or `BlockEmbedding` (False where `block_owner`
        says it has no such place). A tied LM head becomes a `BlockLinear` over the embedding's blocks."""
        module = self.block_owner(name)
        if module is None:
            return False
        if type(module) is nn.Embedding:
            tied_head = module is self.embed_tokens and self.config.tie_word_embeddings
            self.set_submodule(name.removesuffix(".weight"), BlockEmbedding(weight, module.weight.dtype))
            if tied_head:
                self.lm_head = BlockLinear.empty_like(self.lm_head)
                self.lm_head.load_blocks(0, weight)
            return True
        if not isinstance(module, BlockLinear):
            module = BlockLinear.empty_like(module, w8a8=isinstance(module, W8A8Linear))
            self.set_submodule(name.removesuffix(".weight"), module)
        module.load_blocks(offset, weight)
        return True

    def _weight_owner(self, name: str) -> nn.Module | None:
        """The module whose `weight` is `name`, or None when `name` names no module's weight."""
        if not name.endswith(".weight"):
            return None
        try:
            return self.get_submodule(name.removesuffix(".weight"))
        except AttributeError:
            return None

    def _shard_offset(self, name: str, shard: int) -> int:
        cfg = self.config
        if ".qkv_proj." in name:
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            return (0, q, q + kv)[shard]
        return shard * cfg.intermediate_size

    def _weight_row_loaders(self) -> dict[str, Callable[[int, torch.Tensor], None]]:
        """`<module>.weight` -> the loader of each quantized layer's weight."""
        return {
            f"{name}.weight": module.load_weight_rows
            for name, module in self.named_modules()
            if hasattr(module, "load_weight_rows")
        }

    def _expected_shards(self) -> set[str]:
        shard_counts = Counter(ours for ours, _ in self.stacked_params.values())
        expected = set()
        for name in [*(name for name, _ in self.named_parameters()), *self._weight_row_loaders()]:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            fused = [count for part, count in shard_counts.items() if f".{part}." in name]
            shards = tuple(range(fused[0])) if fused else (None,)
            expected.update(f"{name}#{s}" for s in shards)
        return expected
