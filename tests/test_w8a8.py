"""`--quantization w8a8_int8`: the C++ W8A8 linear against its torch reference bit for bit, a row's output
independent of its batch, and greedy output equal to Hugging Face's model running the same arithmetic
(int8 weights, each token's activations quantized to int8 before every linear) on the families."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from conftest import engine_for, hf_greedy, random_prompts, tiny_hf_model
from test_disagg_families import generate_all, max_new
from test_disagg_serving import RunningDecode, RunningPrefill
from test_model_families import hf_model
from test_moe_families import tiny_moe
from tiny_tokenizer import build_tiny_tokenizer
from torch import nn

from base.errors import ConfigError
from engine import quantization
from engine.config import EngineConfig
from engine.engine import GenerateRequest
from engine.model_runner import ScheduledChunk
from engine.params import SamplingParams, StoppingParams
from kernels import w8a8_linear
from kernels.int8_linear import dequantize, quantize_per_channel
from kernels.moe import W8A8Experts
from kernels.w8a8_linear import W8A8Linear, w8a8_linear_reference

GREEDY = SamplingParams(temperature=0.0)
ISAS = ("avx512", "avx2", "portable")
# (rows, features, outputs): tails of every vector width, one row (the single-stream GEMV), rows either
# side of the GEMV's limit, and a prefill-sized block; for the VNNI GEMV's tiles of 4 W rows by 4 x rows,
# every remainder of W rows and of x rows, and features one past and one short of its 64-byte vectors.
SHAPES = [
    (1, 7, 3),
    (1, 640, 300),
    (2, 33, 65),
    (3, 65, 6),
    (5, 100, 17),
    (6, 127, 9),
    (7, 191, 38),
    (8, 64, 48),
    (9, 130, 70),
    (17, 1031, 25),
    (40, 257, 129),
]


def activations(rows: int, features: int, seed: int) -> torch.Tensor:
    """Gaussian rows with a few large outliers (as residual streams have) and one all-zero row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=gen) * 2
    x[:, torch.randint(0, features, (3,), generator=gen)] *= 40
    if rows > 2:
        x[1] = 0
    return x


def float64_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias) -> torch.Tensor:
    """The W8A8 arithmetic with the int8 products summed in float64 (exact), independent of `_int_mm`."""
    xq, row_scale = quantize_per_channel(x)
    acc = (xq.double() @ qweight.double().t()).float()
    y = acc * row_scale.unsqueeze(1) * scale.unsqueeze(0)
    return y if bias is None else y + bias


def restore_widest(extension) -> None:
    for name in ISAS:
        with contextlib.suppress(RuntimeError):
            extension.set_gemv_isa(name)
            return


@pytest.mark.parametrize("isa_name", ISAS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_kernel_equals_the_reference_bit_for_bit(extension, isa_name, shape):
    rows, features, outputs = shape
    try:
        extension.set_gemv_isa(isa_name)
    except RuntimeError:
        pytest.skip(f"this CPU has no {isa_name}")
    try:
        x = activations(rows, features, seed=rows * 31 + features)
        qweight, scale = quantize_per_channel(torch.randn(outputs, features) * 0.1)
        bias = torch.randn(outputs)
        for b in (None, bias):
            expected = float64_reference(x, qweight, scale, b)
            assert torch.equal(w8a8_linear_reference(x, qweight, scale, b), expected)
            sums = qweight.sum(dim=1, dtype=torch.int32)
            paths = {
                "oneDNN": extension.linear_w8a8(x, qweight, scale, b, 0),
                "GEMV": extension.linear_w8a8(x, qweight, scale, b, 64),
                "VNNI (oneDNN without VNNI)": extension.linear_w8a8(x, qweight, scale, b, 0, sums, 64),
            }
            for path, got in paths.items():
                assert torch.equal(got, expected), (path, (got - expected).abs().max())
        xq, row_scale = extension.quantize_rows_int8(x)
        expected_q, expected_scale = quantize_per_channel(x)
        assert torch.equal(xq, expected_q) and torch.equal(row_scale, expected_scale)
    finally:
        restore_widest(extension)


def test_quantized_activations_round_half_to_even_and_clamp():
    x = torch.tensor([[127.0, -127.0, 0.5, 1.5, -2.5, 63.5], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    xq, row_scale = quantize_per_channel(x)
    assert xq.tolist() == [[127, -127, 0, 2, -2, 64], [0, 0, 0, 0, 0, 0]]
    assert row_scale.tolist() == [1.0, 0.0]


def test_a_row_gives_the_same_output_alone_or_in_any_batch(extension):
    """Each row is quantized alone and its int32 sums are exact, so decoding alone or beside 39 other
    sequences (the GEMV or oneDNN's GEMM) gives the same bits."""
    x = activations(40, 320, seed=5)
    qweight, scale = quantize_per_channel(torch.randn(1000, 320))
    batch = extension.linear_w8a8(x, qweight, scale, None, w8a8_linear.GEMV_MAX_ROWS)
    for row in (0, 1, 17, 39):
        alone = extension.linear_w8a8(x[row : row + 1], qweight, scale, None, w8a8_linear.GEMV_MAX_ROWS)
        assert torch.equal(alone[0], batch[row])


def test_the_float64_fallback_sums_exactly_what_int_mm_does(monkeypatch):
    """Off the CPU a shape `torch._int_mm` refuses is summed in float64; both give the same int32."""
    x = activations(9, 200, seed=2)
    qweight, scale = quantize_per_channel(torch.randn(70, 200))
    with_int_mm = w8a8_linear_reference(x, qweight, scale, None)
    monkeypatch.setattr(w8a8_linear, "_int_mm_takes", lambda xq, qweight: False)
    assert torch.equal(w8a8_linear_reference(x, qweight, scale, None), with_int_mm)


def test_the_kernel_refuses_what_would_overflow_int32(extension):
    features = 2**31 // (127 * 127) + 1
    qweight = torch.zeros(1, features, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="at most 133144 input features"):
        extension.linear_w8a8(torch.zeros(1, features), qweight, torch.ones(1), None, 8)


def quantized_weight_storages(model: nn.Module) -> set[int]:
    """The storages of the weights `w8a8_int8` quantizes: every decoder linear and expert matrix, and the
    LM head (the routers and norms stay full precision)."""
    storages = {model.lm_head.weight.untyped_storage().data_ptr()}
    for name, param in model.named_parameters():
        if "layers." in name and name.endswith(("proj.weight", "_proj")) and param.dim() >= 2:
            storages.add(param.untyped_storage().data_ptr())
    return storages


@contextlib.contextmanager
def computing_w8a8(model: nn.Module) -> Iterator[nn.Module]:
    """A copy of an HF model whose embedding holds its int8 round trip and whose quantized weights (by
    storage) go through `w8a8_linear_reference` wherever Hugging Face's code calls `F.linear` (its
    `nn.Linear`s and its experts alike): the arithmetic `w8a8_int8` serving must equal."""
    reference = copy.deepcopy(model)
    head = reference.lm_head
    head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)  # untied, kept as it was
    embedding = reference.get_input_embeddings()
    embedding.weight.data = dequantize(*quantize_per_channel(embedding.weight))
    storages = quantized_weight_storages(reference)
    linear = F.linear

    def w8a8(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if weight.untyped_storage().data_ptr() not in storages:
            return linear(x, weight, bias)
        return w8a8_linear_reference(x, *quantize_per_channel(weight), bias)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(F, "linear", w8a8)
        yield reference


# The largest logit gap at which the engine may pick the other token of a near tie. Quantizing activations
# is discontinuous: an fp32 rounding difference (HF's summation order against ours) can move x / s across a
# rounding boundary, which shifts logits by ~1e-3 (fp32 arithmetic alone shifts them by ~1e-6).
NEAR_TIE = 0.01


def assert_greedy_parity(hf: nn.Module, engine, prompts: list[list[int]], budget: int) -> None:
    """Each prompt's greedy tokens equal the reference's, or first differ where the reference's top two
    logits are within NEAR_TIE and the engine chose the other one of them; at most one prompt may."""
    max_new = [5 + (i * 5) % 9 for i in range(len(prompts))]
    requests = [
        GenerateRequest(p, GREEDY, StoppingParams(max_tokens=n, ignore_eos=True))
        for p, n in zip(prompts, max_new, strict=True)
    ]
    seqs = engine.generate(requests, max_num_batched_tokens=budget, max_num_seqs=6)
    ties = []
    with computing_w8a8(hf) as reference:
        for prompt, n, seq in zip(prompts, max_new, seqs, strict=True):
            want, got = hf_greedy(reference, prompt, n), seq.output_token_ids
            if got == want:
                continue
            at = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
            with torch.no_grad():
                logits = reference(torch.tensor([prompt + want[:at]])).logits[0, -1]
            gap = (logits[want[at]] - logits[got[at]]).item()
            assert gap < NEAR_TIE, f"{len(prompt)}-token prompt diverged at {at}, logit gap {gap}"
            ties.append(len(prompt))
    assert len(ties) <= 1, f"prompts of {ties} tokens all diverged at near ties"


def prompt_logits(engine, prompt: list[int]) -> torch.Tensor:
    """The engine model's logits at every position of `prompt`, prefilled in one chunk."""
    seq = engine.make_sequence(prompt, GREEDY, StoppingParams(max_tokens=1))
    engine.allocate(seq, seq.num_tokens)
    input_ids, positions, meta = engine.runner.prepare([ScheduledChunk(seq, seq.num_tokens)])
    with torch.inference_mode():
        hidden = engine.model(input_ids, positions, engine.kv_cache, meta)
        logits = engine.model.compute_logits(hidden)
    engine.free(seq)
    return logits


@pytest.mark.parametrize("name", ["gemma3_text", "qwen2"])
def test_logits_are_hf_computing_w8a8_not_the_dequantized_weights(name):
    """Logits, which move where tokens need not: within fp32 noise (amplified by an occasional rounding
    flip) of the W8A8 reference, and clearly apart from weight-only int8's."""
    hf = hf_model(name)
    engine = engine_for(hf, block_size=8, num_blocks=40, quantization="w8a8_int8")
    prompt = random_prompts(1, 9, min_len=50, max_len=50)[0]
    got = prompt_logits(engine, prompt)
    with computing_w8a8(hf) as reference, torch.no_grad():
        want = reference(torch.tensor([prompt])).logits[0]
    weight_only = engine_for(hf, block_size=8, num_blocks=40, quantization="int8")
    apart = (prompt_logits(weight_only, prompt) - want).abs().max().item()
    close = (got - want).abs().max().item()
    assert close < 2e-3 and apart > 10 * close, (close, apart)


def test_llama_greedy_equals_hf_computing_w8a8():
    """Mixed steps: prefill chunks past the GEMV's rows beside decodes of up to six sequences; the C++
    decoder stack (fp32 activations) stands aside."""
    hf = tiny_hf_model(21, kind="llama", num_heads=4, num_kv_heads=2, head_dim=64)
    engine = engine_for(hf, num_blocks=160, shuffle_seed=21, quantization="w8a8_int8")
    assert engine.model.decode_stack is None
    assert all(isinstance(layer.self_attn.qkv_proj, W8A8Linear) for layer in engine.model.layers)
    assert isinstance(engine.model.lm_head, W8A8Linear)
    assert_greedy_parity(hf, engine, random_prompts(8, 21, min_len=2, max_len=70), budget=37)


@pytest.mark.parametrize("name", ["gemma3_text", "qwen2", "phi3_window"])
def test_families_greedy_equal_hf_computing_w8a8(name):
    """Gemma 3 (tied head, sliding windows shorter than the prompts, GELU), Qwen2 (qkv bias, tied) and
    Phi-3 (fused checkpoint tensors)."""
    hf = hf_model(name)
    engine = engine_for(hf, block_size=8, num_blocks=120, shuffle_seed=4, quantization="w8a8_int8")
    assert_greedy_parity(hf, engine, random_prompts(6, len(name), min_len=25, max_len=60), budget=23)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_moe_greedy_equals_hf_computing_w8a8(kind):
    hf = tiny_moe(kind, seed=5)
    engine = engine_for(hf, block_size=8, num_blocks=96, quantization="w8a8_int8")
    experts = [m for m in engine.model.modules() if isinstance(m, W8A8Experts)]
    assert experts, "the experts were not quantized W8A8"
    assert_greedy_parity(hf, engine, random_prompts(5, 5, max_len=50), budget=29)


def test_w8a8_replicas_never_share_kv_with_int8_ones():
    marks = {quantization.weights_fingerprint("abc", name) for name in quantization.CHOICES}
    assert len(marks) == len(quantization.CHOICES)


def test_w8a8_needs_fp32_activations_on_the_cpu():
    with pytest.raises(ConfigError, match="--quantization w8a8_int8 on the CPU runs fp32 activations"):
        EngineConfig(quantization="w8a8_int8", dtype=torch.bfloat16)


@pytest.mark.slow
def test_disaggregated_w8a8_equals_aggregated(tmp_path):
    """Gemma's layout (tied head, sliding windows) with both tiers W8A8: the prefill tier's KV, moved
    over the wire, decodes to the tokens one aggregated engine gives, since each row's arithmetic is the
    same whichever batch and process it runs in."""
    hf = hf_model("gemma3_text")
    hf.save_pretrained(tmp_path)
    build_tiny_tokenizer(tmp_path)
    prompts = random_prompts(4, 8, min_len=25, max_len=70)
    engine = engine_for(hf, block_size=16, num_blocks=128, quantization="w8a8_int8")
    requests = [
        GenerateRequest(p, GREEDY, StoppingParams(max_tokens=max_new(i), ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    expected = [seq.output_token_ids for seq in engine.generate(requests, max_num_seqs=4)]
    prefill = RunningPrefill(tmp_path, token_budget=32, num_blocks=128, quantization="w8a8_int8")
    decode = RunningDecode(tmp_path, num_blocks=128, prefill=prefill.address, quantization="w8a8_int8")
    try:
        assert generate_all(decode, prompts, wave=0) == expected
        assert decode.stats.remote_prefills_completed == len(prompts)
        assert not decode.locally_prefilled_request_ids(), "a prompt was prefilled on decode"
    finally:
        decode.close()
        prefill.close()
