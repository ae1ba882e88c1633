"""Mixture-of-experts feed-forward: routing, the expert weights of a layer, and the CPU path that runs them.

A sparse MoE layer replaces a decoder layer's MLP with `E` SwiGLU experts and a router: each token's
router logits go through a softmax, its `top_k` most probable experts run on it, and their outputs are
summed with the routing weights. Families differ only in those weights: Mixtral renormalises the top-k
probabilities to sum to one, Qwen3-MoE only when its config says `norm_topk_prob` (`route`).

A layer's experts are one tensor each for all experts, as Hugging Face holds them in memory and the
GPU kernel reads them: `w_gate_up [E, 2I, H]` (gate rows first, then up) and `w_down [E, H, I]`
(`Experts`; `Int8Experts` for `--quantization int8`: int8 rows, one fp32 scale per output row, as
`kernels.int8_linear` quantizes a dense linear).

The CPU path (`sorted_experts`) groups the step's (token, expert) pairs by expert and runs each active
expert once, as two matmuls over all the rows routed to it, then adds its rows back into the output
weighted by the router (`index_add_`): a step costs one GEMM pair per active expert, whatever its token
count, instead of a loop over tokens. On CUDA the Triton grouped GEMM (`kernels.triton_moe`) runs
instead (`fused_experts` picks). `moe_reference` is the plain per-(token, expert) computation both are
tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from kernels import torch_reference
from kernels.int8_linear import GEMV_MAX_ROWS as INT8_GEMV_MAX_ROWS
from kernels.int8_linear import Int8Linear, quantize_per_channel
from kernels.w8a8_linear import W8A8Linear, w8a8_linear

# Rows up to which an fp32 expert runs on the extension's streaming GEMV rather than MKL: the dense
# linears' threshold (`kernels.cpu_linear.GEMV_MAX_ROWS`), whose measurement holds for one expert too.
FP32_GEMV_MAX_ROWS = 16
# (token, expert) pairs up to which a step groups them by expert in Python rather than with a sort and
# a bincount: a decode step's few pairs, where each tensor op costs more than the grouping.
HOST_GROUPING_MAX_PAIRS = 64

SiluAndMul = Callable[[torch.Tensor], torch.Tensor]


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weights, expert_ids)`, both `[T, top_k]`: the fp32 softmax probabilities of each token's `top_k`
    most probable experts (ties: the lower expert id, as `torch.topk`), renormalised to sum to one when
    `renormalize` (Mixtral always; Qwen3-MoE when `norm_topk_prob`)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_reference(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """`sum_k weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))` with `e = ids[t, k]`, computed per
    (token, expert) pair from gathered weights: the definition, for tests (memory `T * top_k` experts)."""
    width = w_down.shape[-1]
    gate_up = torch.einsum("th,tkoh->tko", hidden.float(), w_gate_up[ids].float())
    act = F.silu(gate_up[..., :width]) * gate_up[..., width:]
    out = torch.einsum("tki,tkhi->tkh", act, w_down[ids].float())
    return (out * weights.float().unsqueeze(-1)).sum(dim=1).to(hidden.dtype)


class Experts(nn.Module):
    """The experts of one layer in the model's dtype: `w_gate_up [E, 2I, H]`, `w_down [E, H, I]`.

    `extension` (the C++ CPU kernels, handed over by `use_cpu_kernels`) runs an expert's few-row fp32
    matmuls on the streaming GEMV; without it, or for more rows, `F.linear` does.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size
        like = {"device": device, "dtype": dtype}
        gate_up = torch.empty(num_experts, 2 * intermediate_size, hidden_size, **like)
        self.w_gate_up = nn.Parameter(gate_up, requires_grad=False)
        down = torch.empty(num_experts, hidden_size, intermediate_size, **like)
        self.w_down = nn.Parameter(down, requires_grad=False)
        self.extension: ModuleType | None = None

    @torch.no_grad()
    def load(self, which: str, expert: int | None, row_offset: int, tensor: torch.Tensor) -> None:
        """Copy a checkpoint tensor into `which` ("gate_up" or "down") at output rows `row_offset...`:
        one expert's `[rows, in]` (`expert` its index), or every expert's `[E, rows, in]` (`expert` None)."""
        target = self.w_gate_up if which == "gate_up" else self.w_down
        if expert is None:
            target.narrow(1, row_offset, tensor.shape[1]).copy_(tensor)
        else:
            target[expert].narrow(0, row_offset, tensor.shape[0]).copy_(tensor)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(w_gate_up, w_down)` in the model's dtype (what the GPU kernel and the reference read)."""
        return self.w_gate_up, self.w_down

    def gate_up(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.w_gate_up[expert])

    def down(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.w_down[expert])

    def _linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        native = x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
        if self.extension is not None and native and x.shape[0] <= FP32_GEMV_MAX_ROWS:
            return self.extension.linear_gemv(x, weight, None)
        return F.linear(x, weight)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}"


class Int8Experts(nn.Module):
    """`Experts` with weight-only int8 rows: `q = round(W / scale)`, one fp32 scale per output row of each
    expert (`kernels.int8_linear`'s scheme), loaded by quantizing each checkpoint tensor as it comes.

    With the extension and fp32 activations on the CPU, each expert runs the dense int8 kernels (GEMV for
    few rows, GEMM beyond); elsewhere it dequantizes the expert and calls `F.linear`.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        extension: ModuleType | None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size
        two_i = 2 * intermediate_size
        int8 = {"dtype": torch.int8, "device": device}
        fp32 = {"dtype": torch.float32, "device": device}
        self.register_buffer("q_gate_up", torch.zeros(num_experts, two_i, hidden_size, **int8))
        self.register_buffer("scale_gate_up", torch.zeros(num_experts, two_i, **fp32))
        self.register_buffer("q_down", torch.zeros(num_experts, hidden_size, intermediate_size, **int8))
        self.register_buffer("scale_down", torch.zeros(num_experts, hidden_size, **fp32))
        self.extension = extension

    @classmethod
    def empty_like(cls, experts: Experts, extension: ModuleType | None) -> Int8Experts:
        """All-zero int8 experts of `experts`' shape and device, filled by `load`."""
        device = experts.w_gate_up.device
        return cls(experts.num_experts, experts.hidden_size, experts.intermediate_size, extension, device)

    @torch.no_grad()
    def load(self, which: str, expert: int | None, row_offset: int, tensor: torch.Tensor) -> None:
        """As `Experts.load`, quantizing each output row of `tensor` on the way in."""
        q_all, scale_all = (
            (self.q_gate_up, self.scale_gate_up) if which == "gate_up" else (self.q_down, self.scale_down)
        )
        tensor = tensor.to(q_all.device)
        experts = range(self.num_experts) if expert is None else [expert]
        for index, e in enumerate(experts):
            q, scale = quantize_per_channel(tensor[index] if expert is None else tensor)
            q_all[e, row_offset : row_offset + q.shape[0]] = q
            scale_all[e, row_offset : row_offset + q.shape[0]] = scale

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(w_gate_up, w_down)` as fp32 `q * scale`: the weights the int8 experts stand for."""
        return (
            self.q_gate_up.float() * self.scale_gate_up.unsqueeze(-1),
            self.q_down.float() * self.scale_down.unsqueeze(-1),
        )

    def gate_up(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.q_gate_up[expert], self.scale_gate_up[expert])

    def down(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.q_down[expert], self.scale_down[expert])

    def _linear(self, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if self.extension is None or x.device.type != "cpu" or x.dtype != torch.float32:
            return F.linear(x, (qweight.float() * scale.unsqueeze(1)).to(x.dtype))
        if x.shape[0] <= INT8_GEMV_MAX_ROWS:
            return self.extension.linear_int8_gemv(x, qweight, scale, None)
        return self.extension.linear_int8_gemm(x, qweight, scale, None)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}"


class W8A8Experts(Int8Experts):
    """`Int8Experts` computed W8A8: each routed row's activations are quantized to int8 before each expert
    (`kernels.w8a8_linear`), as the dense layers of a `w8a8_int8` model are."""

    def _linear(self, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return w8a8_linear(x, qweight, scale, None, self.extension)


AnyExperts = Experts | Int8Experts

# The int8 experts a quantization method's linear module stands for (`engine.quantized_layers.linear_module`
# gives the platform the module's constructor only; this maps it to the experts' one).
_QUANTIZED_EXPERTS: dict[object, Callable[[Experts, ModuleType | None], nn.Module]] = {
    Int8Linear.empty_like: Int8Experts.empty_like,
    W8A8Linear.empty_like: W8A8Experts.empty_like,
}


def quantize_experts(
    layers: nn.Module,
    quantized_linear: Callable[[nn.Linear, ModuleType | None], nn.Module],
    extension: ModuleType | None,
) -> int:
    """Replace every `Experts` inside `layers` by the empty quantized experts of the method whose linear
    module is `quantized_linear`; return how many. Called before the checkpoint loads, as the linears are.

    Raises ValueError for a method that has no expert form.
    """
    targets = [(name, module) for name, module in layers.named_modules() if isinstance(module, Experts)]
    if targets and quantized_linear not in _QUANTIZED_EXPERTS:
        raise ValueError(f"the weight quantization {quantized_linear!r} has no mixture-of-experts form")
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = layers.get_submodule(parent_name) if parent_name else layers
        setattr(parent, child, _QUANTIZED_EXPERTS[quantized_linear](module, extension))
    return len(targets)


def use_cpu_kernels(model: nn.Module, extension: ModuleType | None) -> int:
    """Hand `extension` to every fp32 `Experts` of `model` (their few-row matmuls then stream on its
    GEMV); return how many."""
    targets = [m for m in model.modules() if isinstance(m, Experts) and m.w_gate_up.dtype == torch.float32]
    for module in targets:
        module.extension = extension
    return len(targets)


def has_experts(model: nn.Module) -> bool:
    """Whether any layer of `model` is a mixture of experts (whose MLP the C++ decoder stack cannot run)."""
    return any(isinstance(m, Experts | Int8Experts) for m in model.modules())


def _groups_on_host(ids: torch.Tensor) -> list[tuple[int, int | torch.Tensor]]:
    """`(expert, pairs)` for a small step, grouped in Python from one host copy of `ids`: a pair index
    alone where an expert has one pair (its rows are then views, not gathers), else their tensor."""
    groups: dict[int, list[int]] = {}
    for pair, expert in enumerate(ids.reshape(-1).tolist()):
        groups.setdefault(expert, []).append(pair)
    return [
        (expert, pairs[0] if len(pairs) == 1 else torch.tensor(pairs, device=ids.device))
        for expert, pairs in sorted(groups.items())
    ]


def _groups_by_sort(ids: torch.Tensor, num_experts: int) -> list[tuple[int, int | torch.Tensor]]:
    """`(expert, pairs)` for a large step: pairs sorted by expert (stably: token order within an expert),
    split by the per-expert counts, which come to the host once."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return [(e, pairs) for e, pairs in enumerate(order.split(counts)) if counts[e]]


def sorted_experts(
    hidden: torch.Tensor,
    experts: AnyExperts,
    weights: torch.Tensor,
    ids: torch.Tensor,
    silu_and_mul: SiluAndMul = torch_reference.silu_and_mul,
) -> torch.Tensor:
    """The CPU path: every active expert once, over all rows routed to it (module doc).

    Experts run in increasing id order and each adds its weighted rows into the output in the
    activation dtype, as Hugging Face's loop does, so the sums round alike. A decode-sized step groups
    its pairs on the host (`HOST_GROUPING_MAX_PAIRS`), where a sort and a bincount would cost more
    than the experts' GEMVs; a larger one sorts on the tensor side.
    """
    top_k = ids.shape[1]
    if ids.numel() <= HOST_GROUPING_MAX_PAIRS:
        groups = _groups_on_host(ids)
    else:
        groups = _groups_by_sort(ids, experts.num_experts)
    pair_weights = weights.reshape(-1)
    out = torch.zeros_like(hidden)
    for expert, pairs in groups:
        if isinstance(pairs, int):
            token = pairs // top_k
            x, weight = hidden.narrow(0, token, 1), pair_weights.narrow(0, pairs, 1)
        else:
            tokens = pairs // top_k
            x, weight = hidden.index_select(0, tokens), pair_weights.index_select(0, pairs)
        y = experts.down(expert, silu_and_mul(experts.gate_up(expert, x)))
        y = (y * weight.unsqueeze(1)).to(out.dtype)
        if isinstance(pairs, int):
            out.narrow(0, token, 1).add_(y)
        else:
            out.index_add_(0, tokens, y)
    return out


def fused_experts(
    hidden: torch.Tensor,
    experts: AnyExperts,
    weights: torch.Tensor,
    ids: torch.Tensor,
    silu_and_mul: SiluAndMul = torch_reference.silu_and_mul,
) -> torch.Tensor:
    """The experts' weighted sum for `hidden [T, H]` routed as `(weights, ids)`: the Triton grouped GEMM
    on CUDA (int8 experts read as int8 there too), the sorted per-expert path elsewhere and for W8A8
    experts, which the grouped GEMM (fp activations) would compute as weight-only int8."""
    if hidden.device.type != "cuda" or isinstance(experts, W8A8Experts):
        return sorted_experts(hidden, experts, weights, ids, silu_and_mul)
    # Imported here: a CPU process never imports Triton for this.
    from kernels import triton_moe

    if isinstance(experts, Int8Experts):
        return triton_moe.fused_moe(
            hidden,
            experts.q_gate_up,
            experts.q_down,
            weights,
            ids,
            experts.scale_gate_up,
            experts.scale_down,
        )
    return triton_moe.fused_moe(hidden, experts.w_gate_up, experts.w_down, weights, ids)
