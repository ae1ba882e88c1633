"""Our own Llama-family forward pass (Llama 2/3, SmolLM2, TinyLlama, Mistral without sliding window,
Qwen2 with qkv bias) over the paged KV cache.

One forward takes a flat batch of tokens from many sequences at different positions — prefill
chunks and single decode tokens mixed — and the `AttentionMetadata` that says where each
sequence's context lives in the cache. Projections are fused (qkv, gate_up) so a step does
fewer, larger matmuls; `load_weights` maps Hugging Face parameter names onto them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from base.errors import UnsupportedModelError
from engine.config import ModelConfig
from engine.kv_cache import KVCache
from engine.sampler import greedy_argmax
from kernels.backend import AttentionBackend
from kernels.cpu_decode_stack import CpuDecodeStack
from kernels.metadata import AttentionMetadata


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the positions of a step, computed the way Hugging Face does.

    The inverse frequencies come from `transformers`' own RoPE initialisers, so every variant its
    config can name (default, llama3, linear, yarn, ...) gives the same rotation here as there.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hf = config.hf_config
        params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        with torch.device("cpu"):
            inv_freq, scaling = self._inverse_frequencies(config, hf, params, rope_type)
        # A plain attribute, not a buffer: it must stay fp32 when the model is cast to bf16.
        self.inv_freq = inv_freq.float()
        self.scaling = float(scaling)

    @staticmethod
    def _inverse_frequencies(
        config: ModelConfig, hf, params: dict, rope_type: str
    ) -> tuple[torch.Tensor, float]:
        if rope_type == "default":
            theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
            exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float) / config.head_dim
            return 1.0 / (theta**exponents), 1.0
        if rope_type == "dynamic":
            raise UnsupportedModelError("dynamic NTK RoPE changes with sequence length; not supported")
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        return ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def rotate(heads: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """`heads [T, n, head_dim]` times the fp32 orthonormal `rotation`, in fp32: a half-precision copy of
    the matrix would be orthonormal only to 2**-9, and that error would land on every score."""
    return torch.matmul(heads.float(), rotation).to(heads.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.backend = backend
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)

    def forward(
        self,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.backend.apply_rope(q, k, *cos_sin)
        if kv_cache.rotation is not None:
            q, k = rotate(q, kv_cache.rotation), rotate(k, kv_cache.rotation)
        k_cache, v_cache = kv_cache.k[self.layer_index], kv_cache.v[self.layer_index]
        k_scales, v_scales = kv_cache.scales(self.layer_index)
        self.backend.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, k_scales, v_scales)
        out = self.backend.attention(q, k_cache, v_cache, meta, self.scale, k_scales, v_scales)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.backend = backend
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.backend.silu_and_mul(self.gate_up_proj(hidden)))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, backend: AttentionBackend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.backend = backend

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.backend.rms_norm(x, self.weight, self.eps, residual)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.self_attn = Attention(config, layer_index, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.mlp = MLP(config, backend)

    def forward(self, hidden, residual, cos_sin, kv_cache, meta):
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos_sin, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class CausalLM(nn.Module):
    """Decoder stack plus LM head; `forward` returns hidden states, `compute_logits` the fp32 logits."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        # An explicit (uninitialised) weight skips nn.Embedding's random init: the weights are loaded
        # anyway, and on the meta device that init imports torch._dynamo and with it Triton, whose
        # native objects then leak noisily at exit on a CPU machine that never uses them.
        embedding = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=embedding)
        self.rotary = RotaryEmbedding(config)
        self.layers = nn.ModuleList(DecoderLayer(config, i, backend) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Handed over by the platform (`kernels.platform.Platform.specialize`) where the device has them:
        # the layers of a decode-only step in one call, and each row's greedy token straight from the
        # hidden states. None: the layer loop below and the argmax of the logits, which they match.
        self.decode_stack: CpuDecodeStack | None = None
        self.greedy_head: Callable[[torch.Tensor], torch.Tensor] | None = None

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos_sin = self.rotary(positions, hidden.dtype)
        if self.decode_stack is not None and self.decode_stack.accepts(hidden, meta):
            hidden, residual = self.decode_stack(hidden, cos_sin, kv_cache, meta)
        else:
            residual = None
            for layer in self.layers:
                hidden, residual = layer(hidden, residual, cos_sin, kv_cache, meta)
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

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy Hugging Face parameters in, concatenating q/k/v and gate/up into our fused layers.

        A quantized layer (`engine.quantization`) has no full-precision weight to copy into: its
        `load_weight_rows(offset, tensor)` quantizes each checkpoint tensor into its rows instead.
        """
        params = dict(self.named_parameters())
        row_loaders = self._weight_row_loaders()
        fused = {
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", 1),
            "v_proj": ("qkv_proj", 2),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", 1),
        }
        loaded: set[str] = set()
        for hf_name, tensor in state_dict.items():
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            shard = None
            for hf_part, (ours, index) in fused.items():
                if f".{hf_part}." in name:
                    name, shard = name.replace(f".{hf_part}.", f".{ours}."), index
                    break
            offset = 0 if shard is None else self._shard_offset(name, shard)
            if name in row_loaders:
                row_loaders[name](offset, tensor)
            elif name not in params:
                raise KeyError(f"checkpoint parameter {hf_name!r} has no place in the model")
            elif shard is None:
                params[name].data.copy_(tensor)
            else:
                params[name].data.narrow(0, offset, tensor.shape[0]).copy_(tensor)
            loaded.add(f"{name}#{shard}")
        missing = self._expected_shards() - loaded
        if missing:
            raise KeyError(f"checkpoint lacks parameters: {sorted(missing)[:5]}")

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
        expected = set()
        for name in [*(name for name, _ in self.named_parameters()), *self._weight_row_loaders()]:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            shards = (0, 1, 2) if ".qkv_proj." in name else (0, 1) if ".gate_up_proj." in name else (None,)
            expected.update(f"{name}#{s}" for s in shards)
        return expected
