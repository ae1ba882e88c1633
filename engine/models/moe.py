"""The sparse mixture-of-experts block: a decoder layer's MLP replaced by a router and `E` experts.

Families with expert layers (Mixtral, Qwen3-MoE) put a `SparseMoeBlock` where the dense skeleton has
its MLP; it takes and returns `[T, H]` as the MLP does. What differs between them is only the routing
(`kernels.moe.route`: Mixtral renormalises the top-k probabilities, Qwen3-MoE when `norm_topk_prob`,
and Qwen3-MoE rounds the routing weights to the activation dtype before they scale the experts'
outputs, as Hugging Face does) and the names their checkpoints use, which `expert_target` maps:

- in memory, transformers 5 holds the experts fused, `mlp.experts.gate_up_proj [E, 2I, H]` and
  `mlp.experts.down_proj [E, H, I]` (what `state_dict()` gives);
- on disk, its `save_pretrained` writes (and published checkpoints hold) one tensor per expert and
  matrix: Mixtral's `block_sparse_moe.experts.N.w1/w3/w2` (gate, up, down), Qwen3-MoE's
  `mlp.experts.N.gate_proj/up_proj/down_proj`. Mixtral's router is `block_sparse_moe.gate` on disk.

The router stays in the model's dtype under `--quantization int8` (it is not an `nn.Linear`, which is
what the quantizer swaps): it is E rows, and a flipped expert choice would change the whole output.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.decoder import CausalLM, row_blocks
from kernels.backend import AttentionBackend
from kernels.moe import Experts, Int8Experts, fused_experts, route


@dataclass(frozen=True)
class MoeSpec:
    """The shape and routing of one family's expert layers."""

    num_experts: int
    top_k: int
    intermediate_size: int
    # Divide the top-k probabilities by their sum (Mixtral: always; Qwen3-MoE: `norm_topk_prob`).
    renormalize: bool
    # Round the routing weights to the activation dtype before they scale the experts (Qwen3-MoE).
    weights_in_activation_dtype: bool = False


class Router(nn.Module):
    """The router's `[E, H]` weight; a module of its own type so that weight quantization leaves it be."""

    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)


class SparseMoeBlock(nn.Module):
    """Router plus experts, in place of a decoder layer's MLP (module doc)."""

    def __init__(self, hidden_size: int, spec: MoeSpec, backend: AttentionBackend) -> None:
        super().__init__()
        self.spec = spec
        self.backend = backend
        self.gate = Router(spec.num_experts, hidden_size)
        self.experts = Experts(spec.num_experts, hidden_size, spec.intermediate_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(hidden), self.spec.top_k, self.spec.renormalize)
        if self.spec.weights_in_activation_dtype:
            weights = weights.to(hidden.dtype)
        return fused_experts(hidden, self.experts, weights, ids, self.backend.silu_and_mul)


# A checkpoint's expert tensor: `<layer>.<mlp|block_sparse_moe>.experts.` then either one expert's
# matrix (`N.w1.weight`, `N.gate_proj.weight`, ...) or all experts' fused one (`gate_up_proj`).
_EXPERT_NAME = re.compile(
    r"^(?P<block>.+)\.(?:mlp|block_sparse_moe)\.experts\."
    r"(?:(?P<expert>\d+)\.(?P<matrix>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight|(?P<fused>gate_up_proj|down_proj))$"
)
_ROUTER_NAME = re.compile(r"^(?P<block>.+)\.block_sparse_moe\.gate\.weight$")
# One expert's matrix -> (which fused tensor, its shard: 0 gate or down, 1 up).
_MATRICES = {
    "w1": ("gate_up", 0),
    "gate_proj": ("gate_up", 0),
    "w3": ("gate_up", 1),
    "up_proj": ("gate_up", 1),
    "w2": ("down", 0),
    "down_proj": ("down", 0),
}


@dataclass(frozen=True)
class ExpertTarget:
    """Where one checkpoint tensor of experts goes: the experts module, the fused tensor, the expert
    (None: all of them, the tensor is fused) and the shard (gate 0, up 1 of `gate_up`; 0 for `down`)."""

    experts: str
    which: str
    expert: int | None
    shard: int | None

    def shards(self, num_experts: int) -> list[str]:
        """The `expected_shards` keys this tensor fills."""
        experts = range(num_experts) if self.expert is None else [self.expert]
        shards = (0, 1) if self.shard is None else (self.shard,)
        return [shard_key(self.experts, self.which, e, s) for e in experts for s in shards]


def shard_key(experts: str, which: str, expert: int, shard: int) -> str:
    return f"{experts}#{which}#{expert}#{shard}"


def router_name(name: str) -> str:
    """A checkpoint router name on our module path (Mixtral's `block_sparse_moe.gate` is our `mlp.gate`)."""
    match = _ROUTER_NAME.match(name)
    return f"{match['block']}.mlp.gate.weight" if match else name


def expert_target(name: str) -> ExpertTarget | None:
    """Where the checkpoint tensor `name` (without the `model.` prefix) goes, or None if it is not an
    expert's."""
    match = _EXPERT_NAME.match(name)
    if match is None:
        return None
    experts = f"{match['block']}.mlp.experts"
    if match["fused"] is not None:
        which = "gate_up" if match["fused"] == "gate_up_proj" else "down"
        return ExpertTarget(experts, which, None, None if which == "gate_up" else 0)
    which, shard = _MATRICES[match["matrix"]]
    return ExpertTarget(experts, which, int(match["expert"]), shard)


def load_expert_tensor(
    model: nn.Module, target: ExpertTarget, tensor: torch.Tensor, dtype: torch.dtype
) -> list[str]:
    """Copy (or quantize) `tensor` into its experts, converted to `dtype` a block of output rows at a time
    (`row_blocks`: quantized experts quantize each row alone); return the `expected_shards` keys it filled."""
    module = model.get_submodule(target.experts)
    if target.expert is None:
        for start, rows in row_blocks(tensor, dtype, dim=1):
            module.load(target.which, None, start, rows)
    else:
        offset = (target.shard or 0) * module.intermediate_size if target.which == "gate_up" else 0
        for start, rows in row_blocks(tensor, dtype):
            module.load(target.which, target.expert, offset + start, rows)
    return target.shards(module.num_experts)


def expected_shards(model: nn.Module) -> set[str]:
    """Every `shard_key` a complete checkpoint fills, over all expert layers of `model`."""
    expected = set()
    for name, module in model.named_modules():
        if isinstance(module, Experts | Int8Experts):
            for e in range(module.num_experts):
                expected.update(shard_key(name, "gate_up", e, s) for s in (0, 1))
                expected.add(shard_key(name, "down", e, 0))
    return expected


class MoeCausalLM(CausalLM):
    """The skeleton with expert layers: `moe_spec` says their shape and routing, `is_sparse` which layers
    have them; the others keep the dense gated MLP. Loads expert tensors by any of the names in the
    module doc, everything else by the skeleton's loader."""

    def moe_spec(self) -> MoeSpec:
        raise NotImplementedError

    def is_sparse(self, layer_index: int) -> bool:
        return True

    def make_mlp(self, layer_index: int) -> nn.Module:
        if not self.is_sparse(layer_index):
            return super().make_mlp(layer_index)
        return SparseMoeBlock(self.config.hidden_size, self.moe_spec(), self.backend)

    def checkpoint_name(self, hf_name: str) -> str | None:
        name = super().checkpoint_name(hf_name)
        return None if name is None else router_name(name)

    def _load_tensor(
        self,
        hf_name: str,
        name: str,
        tensor: torch.Tensor,
        params: Mapping[str, nn.Parameter],
        row_loaders: Mapping[str, Callable[[int, torch.Tensor], None]],
    ) -> list[str]:
        """An expert's tensor goes straight into its slot of the stacked experts (each expert's matrix
        has its own rows there, so none waits for the others); anything else as the skeleton loads it."""
        target = expert_target(name)
        if target is None:
            return super()._load_tensor(hf_name, name, tensor, params, row_loaders)
        return load_expert_tensor(self, target, tensor, self.dtype)

    def _expected_shards(self) -> set[str]:
        """The skeleton's without the experts' parameters, which are expected by expert and matrix."""
        skeleton = {key for key in super()._expected_shards() if ".mlp.experts." not in key}
        return skeleton | expected_shards(self)
