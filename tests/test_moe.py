"""Mixture-of-experts kernels and block: routing, the sorted CPU path and the Triton grouped GEMM (under
the interpreter) against the per-(token, expert) reference, int8 experts, and the engine's block against
Hugging Face's own sparse MoE blocks."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from engine.models.moe import MoeSpec, SparseMoeBlock, expected_shards, expert_target, load_expert_tensor
from kernels import moe, triton_moe
from kernels.backend import TorchBackend
from kernels.int8_linear import Int8Linear


def random_layer(experts: int, hidden: int, inter: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w_down = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    return w_gate_up, w_down


def random_step(tokens: int, hidden: int, experts: int, top_k: int, seed: int):
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = moe.route(torch.randn(tokens, experts, generator=gen), top_k, renormalize=True)
    return x, weights, ids


def experts_of(w_gate_up: torch.Tensor, w_down: torch.Tensor) -> moe.Experts:
    experts = moe.Experts(w_gate_up.shape[0], w_gate_up.shape[2], w_down.shape[2])
    experts.load("gate_up", None, 0, w_gate_up)
    experts.load("down", None, 0, w_down)
    return experts


# ------------------------------------------------------------------------------------------ routing


def test_route_renormalises_only_when_asked():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 3.0, 1.0]])
    weights, ids = moe.route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, dim=-1)
    assert ids.tolist() == [[0, 1], [1, 2]]
    torch.testing.assert_close(weights, probs.gather(1, ids))
    normed, same_ids = moe.route(logits, 2, renormalize=True)
    assert torch.equal(same_ids, ids)
    torch.testing.assert_close(normed.sum(dim=-1), torch.ones(2))
    torch.testing.assert_close(normed, weights / weights.sum(dim=-1, keepdim=True))


# ------------------------------------------------------------------------------ sorted CPU path

SHAPES = [
    # experts, top_k, tokens, hidden, intermediate
    (3, 1, 1, 20, 12),
    (3, 2, 5, 36, 40),
    (8, 1, 17, 24, 30),
    (8, 2, 1, 20, 12),
    (8, 2, 17, 36, 44),
]


@pytest.mark.parametrize(("experts", "top_k", "tokens", "hidden", "inter"), SHAPES)
def test_sorted_experts_match_the_reference(experts, top_k, tokens, hidden, inter):
    w_gate_up, w_down = random_layer(experts, hidden, inter, seed=tokens)
    x, weights, ids = random_step(tokens, hidden, experts, top_k, seed=tokens)
    expected = moe.moe_reference(x, w_gate_up, w_down, weights, ids)
    got = moe.sorted_experts(x, experts_of(w_gate_up, w_down), weights, ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_sorted_experts_run_each_active_expert_once():
    """One gate/up and one down call per expert that has rows, over all of its rows at once."""
    w_gate_up, w_down = random_layer(8, 24, 16, seed=3)
    x, weights, ids = random_step(17, 24, 8, 2, seed=3)
    experts = experts_of(w_gate_up, w_down)
    calls: list[tuple[int, int]] = []
    gate_up = experts.gate_up
    experts.gate_up = lambda e, rows: calls.append((e, rows.shape[0])) or gate_up(e, rows)
    moe.sorted_experts(x, experts, weights, ids)
    counts = torch.bincount(ids.reshape(-1), minlength=8)
    assert calls == [(e, int(n)) for e, n in enumerate(counts.tolist()) if n]


def test_sorted_experts_on_the_cpu_gemv_match_the_reference(extension):
    """fp32 experts with the C++ kernels: the GEMV for a few rows, MKL past it."""
    w_gate_up, w_down = random_layer(4, 40, 24, seed=5)
    experts = experts_of(w_gate_up, w_down)
    assert moe.use_cpu_kernels(nn.ModuleList([experts]), extension) == 1
    for tokens in (3, 40):
        x, weights, ids = random_step(tokens, 40, 4, 2, seed=tokens)
        expected = moe.moe_reference(x, w_gate_up, w_down, weights, ids)
        torch.testing.assert_close(moe.sorted_experts(x, experts, weights, ids), expected)


# ------------------------------------------------------------------------------------ int8 experts


def int8_experts(w_gate_up, w_down, extension=None, per_expert=False) -> moe.Int8Experts:
    experts, hidden, inter = w_gate_up.shape[0], w_gate_up.shape[2], w_down.shape[2]
    layer = moe.Int8Experts(experts, hidden, inter, extension)
    if per_expert:
        for e in range(experts):
            layer.load("gate_up", e, 0, w_gate_up[e, :inter])
            layer.load("gate_up", e, inter, w_gate_up[e, inter:])
            layer.load("down", e, 0, w_down[e])
    else:
        layer.load("gate_up", None, 0, w_gate_up)
        layer.load("down", None, 0, w_down)
    return layer


def test_int8_experts_quantize_each_output_row():
    w_gate_up, w_down = random_layer(3, 20, 12, seed=7)
    fused, per_expert = int8_experts(w_gate_up, w_down), int8_experts(w_gate_up, w_down, per_expert=True)
    for name in ("q_gate_up", "scale_gate_up", "q_down", "scale_down"):
        assert torch.equal(getattr(fused, name), getattr(per_expert, name)), name
    deq_gate_up, deq_down = fused.dequantized()
    assert torch.all((deq_gate_up - w_gate_up).abs() <= fused.scale_gate_up.unsqueeze(-1) / 2 + 1e-7)
    assert torch.all((deq_down - w_down).abs() <= fused.scale_down.unsqueeze(-1) / 2 + 1e-7)
    assert torch.equal(fused.scale_gate_up, w_gate_up.abs().amax(dim=-1) / 127)


@pytest.mark.parametrize("tokens", [2, 30])
def test_int8_experts_on_the_cpu_kernels_match_the_dequantized_reference(extension, tokens):
    """The int8 GEMV (few rows per expert) and GEMM (past `int8_linear.GEMV_MAX_ROWS`)."""
    w_gate_up, w_down = random_layer(3, 36, 20, seed=tokens)
    layer = int8_experts(w_gate_up, w_down, extension)
    x, weights, ids = random_step(tokens, 36, 3, 2, seed=tokens)
    expected = moe.moe_reference(x, *layer.dequantized(), weights, ids)
    torch.testing.assert_close(moe.sorted_experts(x, layer, weights, ids), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        moe.sorted_experts(x, int8_experts(w_gate_up, w_down), weights, ids), expected, rtol=1e-5, atol=1e-5
    )


def test_quantize_experts_swaps_in_int8_experts_for_the_int8_method():
    block = SparseMoeBlock(16, MoeSpec(4, 2, 8, renormalize=True), TorchBackend(None))
    layers = nn.ModuleList([nn.ModuleDict({"mlp": block})])
    assert moe.quantize_experts(layers, Int8Linear.empty_like, None) == 1
    assert isinstance(block.experts, moe.Int8Experts) and block.experts.q_down.shape == (4, 16, 8)
    assert isinstance(block.gate, nn.Module) and block.gate.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="no mixture-of-experts form"):
        fresh = nn.ModuleList([SparseMoeBlock(16, block.spec, TorchBackend(None))])
        moe.quantize_experts(fresh, nn.Linear, None)


# ------------------------------------------------------------------------ Triton (interpreted)


def test_align_by_expert_gives_each_tile_one_expert_and_each_pair_one_slot():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 0], [1, 2]])
    pair_ids, block_experts, num_padded = triton_moe.align_by_expert(ids, 4, block_m=4)
    flat, pairs = ids.reshape(-1), ids.numel()
    padded = int(num_padded)
    # Experts 0, 1, 2 have 3, 2, 5 pairs: runs of 4, 4 and 8 slots; expert 3 none.
    assert padded == 16 and pair_ids.shape[0] % 4 == 0 and pair_ids.shape[0] >= padded
    assert sorted(p for p in pair_ids.tolist() if p < pairs) == list(range(pairs))
    assert all(p == pairs for p in pair_ids[padded:].tolist())
    for tile in range(padded // 4):
        members = [p for p in pair_ids[tile * 4 : tile * 4 + 4].tolist() if p < pairs]
        assert members == sorted(members) and {int(flat[p]) for p in members} <= {int(block_experts[tile])}
    assert block_experts[: padded // 4].tolist() == [0, 1, 2, 2]


TRITON_SHAPES = [
    # experts, top_k, tokens, hidden, intermediate
    (3, 1, 1, 20, 12),
    (8, 2, 5, 24, 30),
    (3, 2, 17, 36, 20),
]


@pytest.mark.parametrize(("experts", "top_k", "tokens", "hidden", "inter"), TRITON_SHAPES)
def test_triton_fused_moe_matches_the_reference(experts, top_k, tokens, hidden, inter):
    w_gate_up, w_down = random_layer(experts, hidden, inter, seed=tokens)
    x, weights, ids = random_step(tokens, hidden, experts, top_k, seed=tokens)
    expected = moe.moe_reference(x, w_gate_up, w_down, weights, ids)
    got = triton_moe.fused_moe(x, w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_triton_fused_moe_reads_int8_experts():
    w_gate_up, w_down = random_layer(8, 36, 20, seed=11)
    layer = int8_experts(w_gate_up, w_down)
    x, weights, ids = random_step(17, 36, 8, 2, seed=11)
    expected = moe.moe_reference(x, *layer.dequantized(), weights, ids)
    got = triton_moe.fused_moe(
        x, layer.q_gate_up, layer.q_down, weights, ids, layer.scale_gate_up, layer.scale_down
    )
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_triton_fused_moe_in_bf16_stays_within_rounding():
    w_gate_up, w_down = random_layer(3, 20, 12, seed=13)
    x, weights, ids = random_step(5, 20, 3, 2, seed=13)
    expected = moe.moe_reference(x, w_gate_up, w_down, weights, ids)
    got = triton_moe.fused_moe(x.bfloat16(), w_gate_up.bfloat16(), w_down.bfloat16(), weights, ids)
    torch.testing.assert_close(got.float(), expected, rtol=3e-2, atol=3e-2)


# ------------------------------------------------------------------ the block against Hugging Face


def hf_block(kind: str, norm_topk_prob: bool = False) -> nn.Module:
    torch.manual_seed(17)
    common = dict(hidden_size=36, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2)
    if kind == "mixtral":
        block = MixtralSparseMoeBlock(MixtralConfig(intermediate_size=20, num_local_experts=5, **common))
    else:
        config = Qwen3MoeConfig(
            moe_intermediate_size=20, num_experts=5, norm_topk_prob=norm_topk_prob, **common
        )
        block = Qwen3MoeSparseMoeBlock(config)
    for param in block.parameters():
        nn.init.normal_(param, std=0.2)
    return block.eval()


@pytest.mark.parametrize(("kind", "norm"), [("mixtral", True), ("qwen3_moe", False), ("qwen3_moe", True)])
def test_block_matches_hugging_face_from_fused_and_per_expert_names(kind, norm):
    hf = hf_block(kind, norm)
    spec = MoeSpec(5, 2, 20, renormalize=norm, weights_in_activation_dtype=kind == "qwen3_moe")
    x = torch.randn(1, 9, 36)
    with torch.no_grad():
        expected = hf(x)[0] if isinstance(hf(x), tuple) else hf(x)
    state = hf.state_dict()
    prefix = "block_sparse_moe" if kind == "mixtral" else "mlp"
    names = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    per_expert = {f"layers.0.{prefix}.gate.weight": state["gate.weight"]}
    for e in range(5):
        gate, up = state["experts.gate_up_proj"][e].chunk(2)
        for name, tensor in zip(names, (gate, up, state["experts.down_proj"][e]), strict=True):
            per_expert[f"layers.0.{prefix}.experts.{e}.{name}.weight"] = tensor
    fused = {f"layers.0.mlp.{name}": tensor for name, tensor in state.items()}
    for checkpoint in (fused, per_expert):
        model = nn.ModuleDict({"layers": nn.ModuleList([nn.ModuleDict({"mlp": None})])})
        model.layers[0]["mlp"] = SparseMoeBlock(36, spec, TorchBackend(None))
        loaded = set()
        for name, tensor in checkpoint.items():
            target = expert_target(name)
            if target is None:
                model.get_parameter(name.replace("block_sparse_moe", "mlp")).data.copy_(tensor)
            else:
                loaded.update(load_expert_tensor(model, target, tensor, torch.float32))
        assert loaded == expected_shards(model)
        got = model.layers[0]["mlp"](x[0])
        torch.testing.assert_close(got, expected[0], rtol=1e-5, atol=1e-5)
