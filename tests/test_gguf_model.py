"""A GGUF file is a model: config, tokenizer and template from its metadata, each tensor in its own type.

The reference is `transformers` loading the same GGUF with `gguf_file=` (which dequantizes every tensor
to fp32): the engine serving the file directly must decode what it decodes, token for token.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import hf_greedy, random_prompts
from gguf import GGMLQuantizationType
from test_disagg_serving import RunningDecode, RunningPrefill, tokens_of
from tiny_gguf import llama_cpp_permute, tiny_gguf_llama, write_tiny_gguf
from transformers import AutoModelForCausalLM, AutoTokenizer

from base.errors import ModelNotFoundError
from engine.checkpoints import open_checkpoint
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine, GenerateRequest
from engine.gguf_checkpoint import unpermute_order
from engine.model_store import model_fingerprint, resolve_model
from engine.params import SamplingParams, StoppingParams
from engine.tokenizer import Tokenizer
from kernels.block_embedding import BlockEmbedding
from kernels.block_linear import GEMV_MAX_ROWS, BlockLinear, block_linear_reference
from kernels.gguf_blocks import BlockWeight
from tandem.tiny_model import IM_END_ID, TINY_VOCAB_SIZE, build_tiny_tokenizer

GREEDY = SamplingParams(temperature=0.0)
MAX_NEW = 12


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    """The same tiny Llama as F32, F16, BF16 and Q8_0 GGUFs, one directory each."""
    files = {}
    model = tiny_gguf_llama()
    for kind in ("F32", "F16", "BF16", "Q8_0"):
        directory = tmp_path_factory.mktemp(kind)
        files[kind] = directory / f"tiny.{kind}.gguf"
        write_tiny_gguf(files[kind], GGMLQuantizationType[kind], model)
    return files


def reference(path: Path) -> torch.nn.Module:
    """What transformers makes of the GGUF: every tensor dequantized to fp32."""
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def engine_of(path: Path) -> Engine:
    config = EngineConfig(dtype=torch.float32, cache=CacheConfig(block_size=16, num_blocks=96))
    return Engine.from_pretrained(resolve_model(str(path)), config)


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16", "Q8_0"])
def test_greedy_equals_transformers_on_the_dequantized_gguf(gguf_files, kind: str):
    path = gguf_files[kind]
    engine, hf = engine_of(path), reference(path)
    prompts = random_prompts(4, seed=3, max_len=40, vocab=TINY_VOCAB_SIZE)
    stopping = StoppingParams(max_tokens=MAX_NEW, ignore_eos=True)
    requests = [GenerateRequest(p, GREEDY, stopping) for p in prompts]
    for prompt, seq in zip(prompts, engine.generate(requests, max_num_batched_tokens=32), strict=True):
        assert seq.output_token_ids == hf_greedy(hf, prompt, MAX_NEW), f"{kind}: {len(prompt)}-token prompt"


def test_q8_0_weights_stay_in_their_blocks_viewing_the_mapped_file(gguf_files):
    path = gguf_files["Q8_0"]
    engine = engine_of(path)
    layers = [m for m in engine.model.modules() if isinstance(m, BlockLinear)]
    # qkv, o, gate_up, down per layer and the untied LM head.
    assert len(layers) == 4 * len(engine.model.layers) + 1
    mapped = _file_mappings(path)
    for layer in layers:
        for _, weight in layer.segments:
            begin = weight.blocks.data_ptr()
            assert weight.blocks.dtype == torch.uint8
            assert any(low <= begin and begin + weight.blocks.nbytes <= high for low, high in mapped)
    assert engine.model.decode_stack is not None
    # Decode rows run the C++ GEMV wherever the extension is built.
    assert all(layer.extension is engine.platform.extension for layer in layers)


def test_q8_0_embedding_and_its_tied_head_read_one_copy_of_the_blocks(tmp_path: Path):
    """A tied model's embedding and LM head both read the file's Q8_0 blocks, nothing dequantized whole,
    and still decode what transformers decodes on the dequantized weights."""
    path = tmp_path / "tied.Q8_0.gguf"
    write_tiny_gguf(path, GGMLQuantizationType.Q8_0, tiny_gguf_llama(tie_word_embeddings=True))
    engine = engine_of(path)
    embedding, head = engine.model.embed_tokens, engine.model.lm_head
    assert isinstance(embedding, BlockEmbedding) and isinstance(head, BlockLinear)
    ((_, head_weight),) = head.segments
    assert head_weight.blocks.data_ptr() == embedding.blocks.data_ptr()
    assert any(low <= embedding.blocks.data_ptr() < high for low, high in _file_mappings(path))
    prompts = random_prompts(3, seed=5, max_len=30, vocab=TINY_VOCAB_SIZE)
    stopping = StoppingParams(max_tokens=MAX_NEW, ignore_eos=True)
    requests = [GenerateRequest(p, GREEDY, stopping) for p in prompts]
    hf = reference(path)
    for prompt, seq in zip(prompts, engine.generate(requests, max_num_batched_tokens=32), strict=True):
        assert seq.output_token_ids == hf_greedy(hf, prompt, MAX_NEW)


def test_q8_0_embedding_lookup_dequantizes_only_its_rows():
    dense = torch.randn(40, 96, generator=torch.Generator().manual_seed(7))
    blocks = torch.from_numpy(gguf.quants.quantize(dense.numpy(), GGMLQuantizationType.Q8_0))
    weight = BlockWeight(blocks, 96, "Q8_0")
    embedding = BlockEmbedding(weight, torch.float32)
    ids = torch.tensor([[3, 39, 0], [3, 17, 5]])
    expected = weight.dequantize()[ids]
    assert torch.equal(embedding(ids), expected)
    with pytest.raises(ValueError, match="token order"):
        BlockEmbedding(
            BlockWeight(weight.blocks, weight.cols, "Q8_0", torch.arange(40).flip(0)), torch.float32
        )


def test_q8_0_linear_matches_float64_reference_over_odd_shapes():
    generator = torch.Generator().manual_seed(0)
    for rows, cols, tokens, heads in ((7, 32, 1, None), (33, 96, 3, None), (64, 160, 17, 4), (12, 64, 5, 3)):
        dense = torch.randn(rows, cols, generator=generator)
        stored = dense.numpy() if heads is None else llama_cpp_permute(dense.numpy(), heads)
        blocks = torch.from_numpy(gguf.quants.quantize(stored, GGMLQuantizationType.Q8_0))
        order = None if heads is None else unpermute_order(rows, heads)
        weight = BlockWeight(blocks, cols, "Q8_0", order)
        dequantized = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), GGMLQuantizationType.Q8_0))
        expected_weight = dequantized.double() if order is None else dequantized.double()[order]
        assert torch.equal(weight.dequantize(), expected_weight.float())
        x = torch.randn(tokens, cols, generator=generator)
        _assert_fp32_accurate(block_linear_reference(x, weight), x, expected_weight)
        layer = BlockLinear(rows + 5, cols, None, "cpu")
        # 127 quantizes exactly (scale 1), so the second segment's rows are exact sums of x.
        exact = gguf.quants.quantize(np.full((5, cols), 127.0, np.float32), GGMLQuantizationType.Q8_0)
        extra = BlockWeight(torch.from_numpy(exact), cols, "Q8_0")
        layer.load_blocks(0, weight)
        assert layer.missing_rows() == 5
        layer.load_blocks(rows, extra)
        assert layer.missing_rows() == 0
        both = torch.cat([expected_weight, torch.full((5, cols), 127.0, dtype=torch.float64)])
        _assert_fp32_accurate(layer(x), x, both)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
def test_q8_0_gemv_every_instruction_set_matches_float64(extension, isa: str):
    """The C++ GEMV reads the blocks in place: rows of x 1 to 9 (its 4-row tiles and their remainders),
    odd row counts, K of one block and many, with and without bias, within fp32 rounding of float64."""
    best = extension.gemv_isa()
    try:
        extension.set_gemv_isa(isa)
    except RuntimeError as exc:
        assert "cannot run" in str(exc)
        pytest.skip(f"this CPU has no {isa}")
    generator = torch.Generator().manual_seed(1)
    try:
        for i, (tokens, rows, cols) in enumerate(
            ((1, 7, 32), (2, 33, 96), (3, 64, 160), (5, 13, 1024), (9, 3, 64))
        ):
            dense = torch.randn(rows, cols, generator=generator)
            blocks = torch.from_numpy(gguf.quants.quantize(dense.numpy(), GGMLQuantizationType.Q8_0))
            weight = BlockWeight(blocks, cols, "Q8_0").dequantize().double()
            x = torch.randn(tokens, cols, generator=generator)
            bias = torch.randn(rows, generator=generator) if i % 2 else None
            out = extension.linear_q8_0_gemv(x, blocks, bias)
            _assert_fp32_accurate(out - (0 if bias is None else bias), x, weight)
    finally:
        extension.set_gemv_isa(best)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
@pytest.mark.parametrize(("tokens", "cols"), [(1, 4128), (2, 2080)])
def test_q8_0_gemv_reads_long_rows_of_x_against_groups_of_w_rows(extension, isa: str, tokens: int, cols: int):
    """One or two rows of x past 16 KiB (AVX-512 then reads W rows four at a time): 4-row groups and a
    last partial group, a row count no thread split makes whole, within fp32 rounding of float64, and
    the same values whatever rows of W go with them."""
    best = extension.gemv_isa()
    try:
        extension.set_gemv_isa(isa)
    except RuntimeError as exc:
        assert "cannot run" in str(exc)
        pytest.skip(f"this CPU has no {isa}")
    generator = torch.Generator().manual_seed(tokens)
    try:
        dense = torch.randn(11, cols, generator=generator)
        blocks = torch.from_numpy(gguf.quants.quantize(dense.numpy(), GGMLQuantizationType.Q8_0))
        weight = BlockWeight(blocks, cols, "Q8_0").dequantize().double()
        x = torch.randn(tokens, cols, generator=generator)
        bias = torch.randn(11, generator=generator)
        out = extension.linear_q8_0_gemv(x, blocks, bias)
        _assert_fp32_accurate(out - bias, x, weight)
        shifted = extension.linear_q8_0_gemv(x, blocks[1:].contiguous(), bias[1:])
        assert torch.equal(shifted, out[:, 1:])
    finally:
        extension.set_gemv_isa(best)


def test_q8_0_layer_runs_the_gemv_at_every_row_count(extension):
    """Past the decode stack's rows too: a step's cost then grows at the rate measured at start."""
    generator = torch.Generator().manual_seed(2)
    dense = torch.randn(48, 128, generator=generator)
    blocks = torch.from_numpy(gguf.quants.quantize(dense.numpy(), GGMLQuantizationType.Q8_0))
    layer = BlockLinear(48, 128, None, "cpu")
    layer.load_blocks(0, BlockWeight(blocks, 128, "Q8_0", unpermute_order(48, 3)))
    weight = layer.segments[0][1].dequantize().double()
    layer.extension = extension
    for tokens in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 3 * GEMV_MAX_ROWS + 5):
        x = torch.randn(tokens, 128, generator=generator)
        out = layer(x)
        _assert_fp32_accurate(out, x, weight)
        gemv = extension.linear_q8_0_gemv(x, blocks, None)[:, unpermute_order(48, 3)]
        assert torch.equal(out, gemv)


def test_config_tokenizer_and_template_come_from_the_metadata(gguf_files, tmp_path: Path):
    path = gguf_files["Q8_0"]
    checkpoint = open_checkpoint(path)
    assert checkpoint.config.model_type == "llama"
    assert (checkpoint.config.hidden_size, checkpoint.config.num_key_value_heads) == (128, 2)
    assert {t.dtype for t in checkpoint.stored} == {"F32", "Q8_0"}
    assert sum(t.nbytes for t in checkpoint.stored if t.dtype == "Q8_0") % 34 == 0
    tokenizer = Tokenizer.from_pretrained(path)
    original = AutoTokenizer.from_pretrained(build_tiny_tokenizer(tmp_path / "tok"))
    text = "Hello world, the quick brown fox."
    assert tokenizer.encode(text) == original(text)["input_ids"]
    assert IM_END_ID in tokenizer.eos_token_ids
    chat = [{"role": "user", "content": "hi"}]
    expected = original.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    assert tokenizer.apply_chat_template(chat) == list(expected)


def test_fingerprint_names_the_weight_type(gguf_files):
    fingerprints = {kind: model_fingerprint(path) for kind, path in gguf_files.items()}
    assert len(set(fingerprints.values())) == len(fingerprints)
    assert model_fingerprint(gguf_files["Q8_0"]) == fingerprints["Q8_0"]


def test_a_file_that_is_not_a_gguf_is_still_refused(tmp_path: Path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelNotFoundError, match="is a file"):
        resolve_model(str(path))


def test_q8_0_gguf_serves_disaggregated_like_transformers(gguf_files):
    path = gguf_files["Q8_0"]
    prefill = RunningPrefill(path, num_blocks=128)
    decode = RunningDecode(path, num_blocks=128, prefill=prefill.address)
    try:
        prompt = random_prompts(1, seed=5, min_len=30, max_len=30, vocab=TINY_VOCAB_SIZE)[0]
        output = tokens_of(decode.generate(prompt, max_tokens=8, request_id="gguf-0"))
        assert output == hf_greedy(reference(path), prompt, 8)
        assert decode.stats.remote_prefills_completed == 1
    finally:
        decode.close()
        prefill.close()


def _assert_fp32_accurate(actual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """`actual` is `x W^T` computed in float64, within fp32 rounding of the sum of |products|."""
    expected = x.double() @ weight.T
    bound = 1e-5 * (x.double().abs() @ weight.abs().T) + 1e-6
    assert ((actual.double() - expected).abs() <= bound).all()


def _file_mappings(path: Path) -> list[tuple[int, int]]:
    """Where this process maps `path` (/proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path.resolve()):
            low, high = fields[0].split("-")
            ranges.append((int(low, 16), int(high, 16)))
    return ranges
