"""`--dtype bfloat16` on the CPU end to end: the engine's kernels and cache, its first-step logits and
greedy token against Hugging Face run in bf16, and the identity a tier announces for its KV."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from conftest import engine_for, random_prompts, tiny_hf_model

from engine.engine import GenerateRequest
from engine.params import SamplingParams, StoppingParams
from kernels.cpu_bf16_linear import Bf16Linear
from serving.kv_layout import engine_fingerprint

# Logits of the tiny model span about ±3. bf16 rounding moves them by up to ~0.06 (Hugging Face's bf16
# against its fp32, measured at 0.02-0.06 on these prompts); a wrong kernel moves them by the whole scale.
LOGIT_TOLERANCE = 0.1


def first_step_logits(engine, prompt: list[int]) -> torch.Tensor:
    """The engine's logits of the prompt's last position (its first sampled token)."""
    captured: list[torch.Tensor] = []
    compute = engine.model.compute_logits
    engine.model.compute_logits = lambda hidden: captured.append(compute(hidden)) or captured[-1]
    try:
        stopping = StoppingParams(max_tokens=1, ignore_eos=True)
        engine.generate([GenerateRequest(prompt, SamplingParams(temperature=0.0), stopping)])
    finally:
        del engine.model.compute_logits
    return captured[0][-1]


def hf_logits(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0, -1].float()


@pytest.fixture(scope="module")
def models():
    hf = tiny_hf_model(7)
    return hf, copy.deepcopy(hf).bfloat16(), engine_for(hf, dtype=torch.bfloat16)


def test_bf16_engine_runs_bf16_weights_and_cache_on_the_cpu_kernels(extension, models):
    _, _, engine = models
    assert engine.platform.bf16_linears and not engine.platform.decode_stack
    assert engine.kv_cache.dtype == torch.bfloat16
    projections = [layer.self_attn.qkv_proj for layer in engine.model.layers]
    assert all(isinstance(p, Bf16Linear) and p.weight.dtype == torch.bfloat16 for p in projections)
    assert engine.model.lm_head.fp32_out


def test_bf16_logits_stay_within_bf16_rounding_of_hugging_face(extension, models):
    hf, hf_bf16, engine = models
    decisive = 0
    for prompt in random_prompts(12, 7, min_len=3, max_len=30):
        ours = first_step_logits(engine, prompt)
        theirs, exact = hf_logits(hf_bf16, prompt), hf_logits(hf, prompt)
        assert ours.dtype == torch.float32
        assert (ours - theirs).abs().max() <= LOGIT_TOLERANCE
        assert (ours - exact).abs().max() <= LOGIT_TOLERANCE
        # Where Hugging Face's bf16 top token leads by more than the rounding, ours must be the same one;
        # nearer ties (bf16 logits tie exactly often) may go either way.
        top = theirs.topk(2).values
        if top[0] - top[1] > LOGIT_TOLERANCE:
            decisive += 1
            assert int(ours.argmax()) == int(theirs.argmax())
    assert decisive >= 6, "too few prompts with a clear top token to check the greedy choice"


def test_bf16_tiers_announce_other_weights_than_fp32_ones():
    def fingerprint(dtype: torch.dtype, quantization: str = "none") -> str:
        config = SimpleNamespace(quantization=quantization)
        engine = SimpleNamespace(dtype=dtype, config=config, model=torch.nn.Linear(2, 2))
        return engine_fingerprint(engine, "abc")

    assert fingerprint(torch.float32) == "abc", "fp32 tiers keep the fingerprint earlier versions announce"
    assert fingerprint(torch.bfloat16) == "abc+bfloat16-compute"
    assert fingerprint(torch.bfloat16) != fingerprint(torch.float32)
