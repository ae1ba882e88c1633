"""GGUF Q8_0 linears in the C++ decode stack (exact and w8a8), and the w8a8 Q8_0 kernel against its torch
definition on every instruction set."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import random_prompts
from gguf import GGMLQuantizationType
from test_cpu_decode_stack import forward_both_ways
from tiny_gguf import write_tiny_gguf

from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.gguf_checkpoint import unpermute_order
from engine.model_runner import ScheduledChunk
from engine.model_store import resolve_model
from engine.params import SamplingParams, StoppingParams
from engine.quantization import weights_fingerprint
from kernels.block_linear import BlockLinear
from kernels.cpu_decode_stack import CpuDecodeStack
from kernels.gguf_blocks import BlockWeight
from kernels.q8_0_w8a8 import q8_0_w8a8_reference, quantize_blocks
from tandem.tiny_model import TINY_VOCAB_SIZE


@pytest.fixture(scope="module")
def q8_0_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("q8_0") / "tiny.Q8_0.gguf"
    write_tiny_gguf(path, GGMLQuantizationType.Q8_0)
    return path


def engine_with_prompts(path: Path, quantization: str, num_prompts: int) -> tuple[Engine, list]:
    """An fp32 CPU engine over the GGUF whose sequences' prompts are prefilled, with room to decode."""
    config = EngineConfig(
        dtype=torch.float32, cache=CacheConfig(block_size=16, num_blocks=200), quantization=quantization
    )
    engine = Engine.from_pretrained(resolve_model(str(path)), config)
    seqs = []
    for prompt in random_prompts(num_prompts, seed=num_prompts, min_len=3, max_len=40, vocab=TINY_VOCAB_SIZE):
        seq = engine.make_sequence(prompt, SamplingParams(temperature=0.0), StoppingParams(max_tokens=8))
        engine.allocate(seq, seq.num_tokens + 8)
        engine.step([ScheduledChunk(seq, seq.num_tokens)])
        seqs.append(seq)
    return engine, seqs


@pytest.mark.parametrize(
    ("quantization", "num_seqs"),
    [("none", 1), ("none", 3), ("none", 32), ("w8a8_int8", 1), ("w8a8_int8", 3), ("w8a8_int8", 40)],
)
def test_q8_0_decode_steps_take_the_stack_and_equal_the_per_layer_path(
    extension, q8_0_gguf, monkeypatch, quantization: str, num_seqs: int
):
    """The stack computes the Q8_0 segments (q/k in llama.cpp's row order) where they lie, bit for bit
    what the modules compute, over several steps; exact Q8_0 up to its GEMV's 32 rows, w8a8 past them."""
    engine, seqs = engine_with_prompts(q8_0_gguf, quantization, num_seqs)
    linears = [m for m in engine.model.layers.modules() if isinstance(m, BlockLinear)]
    assert len(linears) == 4 * len(engine.model.layers)
    assert all(linear.w8a8 == (quantization == "w8a8_int8") for linear in linears)
    assert engine.model.decode_stack is not None
    calls = []
    original = CpuDecodeStack.__call__
    monkeypatch.setattr(CpuDecodeStack, "__call__", lambda self, *a: calls.append(1) or original(self, *a))
    for _ in range(3):
        before = len(calls)
        fused, per_layer = forward_both_ways(engine, [ScheduledChunk(seq, 1) for seq in seqs])
        assert len(calls) == before + 1
        assert torch.equal(fused, per_layer)
        engine.step([ScheduledChunk(seq, 1) for seq in seqs])


def test_w8a8_on_a_gguf_keeps_the_q8_0_blocks_and_marks_the_fingerprint(extension, q8_0_gguf):
    engine, _ = engine_with_prompts(q8_0_gguf, "w8a8_int8", 1)
    head = engine.model.lm_head
    assert isinstance(head, BlockLinear) and head.w8a8
    exact = weights_fingerprint("fp", "none", keeps_blocks=True)
    requantized = weights_fingerprint("fp", "w8a8_int8")
    blocks = weights_fingerprint("fp", "w8a8_int8", keeps_blocks=True)
    assert len({exact, requantized, blocks}) == 3
    assert weights_fingerprint("fp", "int8", keeps_blocks=True) == weights_fingerprint("fp", "int8")


def q8_0_blocks(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """Random Q8_0 blocks, with some weights at -128 (which no quantizer writes, but a file may hold)."""
    dense = torch.randn(rows, cols, generator=generator).numpy()
    blocks = gguf.quants.quantize(dense, GGMLQuantizationType.Q8_0).reshape(rows, cols // 32, 34)
    quants = blocks[..., 2:].view(np.int8)
    quants[:, :, 5] = -128
    return torch.from_numpy(blocks.reshape(rows, cols // 32 * 34).copy())


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
def test_q8_0_w8a8_every_instruction_set_equals_the_reference(extension, isa: str):
    """K of 1, 9 and 33 blocks (not multiples of 8 blocks or of 256) and of whole groups of 8, W rows short
    of, at and past the VNNI kernel's tiles of 16 (1, 15, 16, 17, 33, 48), x rows of every remainder of
    its tiles of 4 (1 to 9), zero rows of x, with and without bias: the same bits as the torch
    definition."""
    best = extension.gemv_isa()
    try:
        extension.set_gemv_isa(isa)
    except RuntimeError as exc:
        assert "cannot run" in str(exc)
        pytest.skip(f"this CPU has no {isa}")
    generator = torch.Generator().manual_seed(4)
    try:
        for i, (tokens, rows, cols) in enumerate(
            (
                (1, 7, 32),
                (2, 33, 288),
                (3, 13, 1056),
                (5, 3, 64),
                (9, 17, 96),
                (4, 16, 256),
                (6, 15, 512),
                (7, 48, 320),
                (8, 1, 544),
            )
        ):
            blocks = q8_0_blocks(rows, cols, generator)
            x = torch.randn(tokens, cols, generator=generator) * 3
            x[-1, :32] = 0  # a block whose scale is 0
            bias = torch.randn(rows, generator=generator) if i % 2 else None
            expected = q8_0_w8a8_reference(blocks, cols, x)
            assert torch.equal(
                extension.linear_q8_0_w8a8(x, blocks, bias), expected + (0 if bias is None else bias)
            )
    finally:
        extension.set_gemv_isa(best)


def test_q8_0_w8a8_refuses_features_that_are_not_whole_blocks(extension):
    blocks = q8_0_blocks(4, 64, torch.Generator().manual_seed(5))
    with pytest.raises(RuntimeError, match="blocks of 32"):
        extension.linear_q8_0_w8a8(torch.randn(1, 40), blocks, None)
    with pytest.raises(RuntimeError, match="features"):
        extension.linear_q8_0_w8a8(torch.randn(1, 96), blocks, None)
    with pytest.raises(ValueError, match="blocks of 32"):
        quantize_blocks(torch.randn(2, 40))


def test_w8a8_q8_0_layer_equals_its_torch_path_with_permuted_segments(extension):
    """A fused w8a8 layer (a q segment in llama.cpp's row order, then a plain one) gives the same bits on
    the extension as on the torch reference, at decode rows and past the exact GEMV's 32."""
    generator = torch.Generator().manual_seed(6)
    layer = BlockLinear(48 + 16, 96, None, "cpu", w8a8=True)
    layer.load_blocks(0, BlockWeight(q8_0_blocks(48, 96, generator), 96, "Q8_0", unpermute_order(48, 3)))
    layer.load_blocks(48, BlockWeight(q8_0_blocks(16, 96, generator), 96, "Q8_0"))
    for tokens in (1, 3, 40):
        x = torch.randn(tokens, 96, generator=generator)
        layer.extension = None
        reference = layer(x)
        layer.extension = extension
        assert torch.equal(layer(x), reference)
