"""`kernels.platform`: the kernels chosen for a device, dtype and quantization under the settings, and an
engine that runs what its platform chose."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import engine_for, tiny_hf_model
from torch import nn

from base.settings import CPU_EXTENSION_ENV, ONEDNN_LINEAR_ENV, Settings
from kernels import cpu_extension, cpu_linear, cpu_lm_head, triton_backend
from kernels.backend import TorchBackend
from kernels.cpu_decode_stack import CpuDecodeStack
from kernels.int8_linear import Int8Linear
from kernels.platform import choose_platform

DEFAULTS = Settings()


def test_cpu_fp32_with_the_extension_takes_every_cpu_kernel(extension):
    platform = choose_platform("cpu", torch.float32, settings=DEFAULTS)
    assert platform.device == torch.device("cpu")
    assert isinstance(platform.attention, TorchBackend) and platform.attention._extension is extension
    assert platform.extension is extension
    assert platform.quantized_linear is None
    assert platform.cpu_linears is cpu_linear.available()
    assert platform.cpu_lm_head and platform.decode_stack


def test_cpu_int8_runs_the_quantized_linears_on_the_extension(extension):
    platform = choose_platform("cpu", torch.float32, Int8Linear.empty_like, settings=DEFAULTS)
    layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8)) for _ in range(2))
    assert platform.quantize_linears(layers) == 4
    assert all(type(m) is Int8Linear and m._extension is extension for layer in layers for m in layer)


def test_cpu_bf16_keeps_torch_modules(extension):
    platform = choose_platform("cpu", torch.bfloat16, settings=DEFAULTS)
    assert platform.extension is extension, "attention still serves fp32 tensors through it"
    assert not (platform.cpu_linears or platform.cpu_lm_head or platform.decode_stack)


def test_cpu_with_the_extension_switched_off(monkeypatch):
    monkeypatch.setattr(cpu_extension, "load", lambda: pytest.fail("switched off: nothing may build it"))
    platform = choose_platform("cpu", torch.float32, settings=Settings(cpu_extension=False))
    assert platform.extension is None and platform.attention._extension is None
    assert platform.cpu_linears is cpu_linear.available(), "oneDNN needs no extension"
    assert not (platform.cpu_lm_head or platform.decode_stack)


def test_cpu_with_the_extension_unbuildable(monkeypatch):
    monkeypatch.setattr(cpu_extension, "load", lambda: None)
    platform = choose_platform("cpu", torch.float32, settings=DEFAULTS)
    assert platform.extension is None and platform.attention._extension is None
    assert not (platform.cpu_lm_head or platform.decode_stack)


@pytest.mark.parametrize(
    ("switch", "expected"),
    [
        ({"onednn_linear": False}, {"cpu_linears": False, "cpu_lm_head": False, "decode_stack": True}),
        ({"cpu_decode_stack": False}, {"cpu_lm_head": True, "decode_stack": False}),
    ],
)
def test_each_cpu_switch_turns_off_its_kernels_only(extension, switch, expected):
    platform = choose_platform("cpu", torch.float32, settings=dataclasses.replace(DEFAULTS, **switch))
    assert {name: getattr(platform, name) for name in expected} == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_choices_need_no_gpu(monkeypatch, dtype):
    """Triton attention, no C++ kernels (never built), plain torch modules; int8 on its torch reference."""
    monkeypatch.setattr(cpu_extension, "load", lambda: pytest.fail("no C++ CPU kernels on a GPU"))
    platform = choose_platform("cuda", dtype, Int8Linear.empty_like, settings=DEFAULTS)
    assert platform.device == torch.device("cuda")
    assert isinstance(platform.attention, triton_backend.TritonBackend)
    assert platform.extension is None
    assert platform.quantized_linear == Int8Linear.empty_like
    assert not (platform.cpu_linears or platform.cpu_lm_head or platform.decode_stack)
    torch_attention = choose_platform("cuda", dtype, settings=Settings(attention_backend="torch")).attention
    assert isinstance(torch_attention, TorchBackend) and torch_attention._extension is None


def test_the_engine_runs_what_its_platform_chose(extension):
    engine = engine_for(tiny_hf_model(2), device="cpu")
    model = engine.model
    assert engine.backend is engine.platform.attention
    assert isinstance(model.lm_head, cpu_lm_head.CpuLmHead) and model.greedy_head == model.lm_head.greedy
    assert isinstance(model.decode_stack, CpuDecodeStack)
    linear_type = cpu_linear.CpuLinear if cpu_linear.available() else nn.Linear
    assert type(model.layers[0].self_attn.qkv_proj) is linear_type


def test_an_engine_follows_the_switches_in_its_environment(extension, monkeypatch):
    monkeypatch.setenv(ONEDNN_LINEAR_ENV, "0")
    model = engine_for(tiny_hf_model(2), device="cpu").model
    assert type(model.lm_head) is nn.Linear and model.greedy_head is None
    assert type(model.layers[0].self_attn.qkv_proj) is nn.Linear
    assert model.decode_stack is not None
    monkeypatch.setenv(CPU_EXTENSION_ENV, "0")
    engine = engine_for(tiny_hf_model(2), device="cpu")
    assert engine.backend._extension is None and engine.model.decode_stack is None
