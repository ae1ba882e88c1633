"""GGUFs in the 4-, 5- and 6-bit block types served as stored (issue 56): each type's weights stay blocks
viewing the mapped file, the layer computes what `transformers` computes on the dequantized file, and a
model decodes what `transformers` decodes (`gguf_file=`, which dequantizes every tensor: the reference).

Tiny random Llamas in each type: the `_0`/`_1` types quantized by the `gguf` package, the K types (which
it cannot quantize) as random blocks of the weights' magnitude (`tiny_gguf.random_blocks`), at sizes that
are multiples of their 256-weight blocks.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from conftest import hf_greedy, random_prompts
from gguf import GGMLQuantizationType
from test_gguf_model import _assert_fp32_accurate, _file_mappings, engine_of, reference
from test_load_plan import held_bytes
from tiny_gguf import random_blocks, tiny_gguf_llama, write_tiny_gguf

from engine.checkpoints import open_checkpoint
from engine.engine import GenerateRequest
from engine.gguf_checkpoint import GgufCheckpoint, UnsupportedWeightTypeError
from engine.load_plan import KERNEL_COPIES, check_memory
from engine.memory_limit import MemoryLimit
from engine.model_store import model_fingerprint
from engine.params import SamplingParams, StoppingParams
from kernels.block_embedding import BlockEmbedding
from kernels.block_linear import BlockLinear
from kernels.gguf_blocks import BLOCK_LAYOUTS, BlockWeight, dequantize
from tandem.tiny_model import TINY_VOCAB_SIZE

GREEDY = SamplingParams(temperature=0.0)
MAX_NEW = 8
NEW_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# llama.cpp's Q4_K_M keeps some tensors in Q6_K (v and down projections, the head) beside Q4_K ones.
Q4_K_M = {"attn_v": GGMLQuantizationType.Q6_K, "ffn_down": GGMLQuantizationType.Q6_K}


def tiny_model(kind: str, tied: bool = False):
    """The tiny Llama at sizes `kind`'s blocks divide."""
    size = 256 if BLOCK_LAYOUTS[kind].weights == 256 else None
    sizes = {} if size is None else {"hidden_size": size, "intermediate_size": size}
    return tiny_gguf_llama(tie_word_embeddings=tied, **sizes)


@pytest.fixture(scope="module")
def block_files(tmp_path_factory) -> dict[str, Path]:
    """One tiny GGUF per new block type, and a Q4_K_M mix."""
    files = {}
    for kind in NEW_TYPES:
        files[kind] = tmp_path_factory.mktemp(kind) / f"tiny.{kind}.gguf"
        write_tiny_gguf(files[kind], GGMLQuantizationType[kind], tiny_model(kind))
    files["Q4_K_M"] = tmp_path_factory.mktemp("Q4_K_M") / "tiny.Q4_K_M.gguf"
    write_tiny_gguf(files["Q4_K_M"], GGMLQuantizationType.Q4_K, tiny_model("Q4_K"), Q4_K_M)
    return files


def assert_greedy_equals_transformers(path: Path, seed: int) -> None:
    engine, hf = engine_of(path), reference(path)
    prompts = random_prompts(3, seed=seed, max_len=30, vocab=TINY_VOCAB_SIZE)
    stopping = StoppingParams(max_tokens=MAX_NEW, ignore_eos=True)
    requests = [GenerateRequest(p, GREEDY, stopping) for p in prompts]
    for prompt, seq in zip(prompts, engine.generate(requests, max_num_batched_tokens=32), strict=True):
        assert seq.output_token_ids == hf_greedy(hf, prompt, MAX_NEW), f"{path.name}: {len(prompt)} tokens"


@pytest.mark.parametrize("kind", [*NEW_TYPES, "Q4_K_M"])
def test_greedy_equals_transformers_on_the_dequantized_gguf(block_files, kind: str):
    assert_greedy_equals_transformers(block_files[kind], seed=7)


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K_M"])
def test_weights_stay_blocks_of_their_type_viewing_the_mapped_file(block_files, kind: str):
    path = block_files[kind]
    engine = engine_of(path)
    model = engine.model
    layers = [m for m in model.modules() if isinstance(m, BlockLinear)]
    assert len(layers) == 4 * len(model.layers) + 1
    mapped = _file_mappings(path)
    stored = {(w.kind, w.blocks.data_ptr()) for layer in layers for _, w in layer.segments}
    for _, begin in stored:
        assert any(low <= begin < high for low, high in mapped)
    assert isinstance(model.embed_tokens, BlockEmbedding)
    expected = {"Q4_1"} if kind == "Q4_1" else {"Q4_K", "Q6_K"}
    assert {block_kind for block_kind, _ in stored} == expected
    if kind == "Q4_K_M":
        # q and k in Q4_K, v in Q6_K: one fused layer, a segment of each type.
        assert model.layers[0].self_attn.qkv_proj.kinds == {"Q4_K", "Q6_K"}
    # The C++ decode stack has no kernel for these types: the per-op path runs them.
    assert model.decode_stack is None


def test_a_tied_head_reads_the_embeddings_blocks(tmp_path: Path):
    path = tmp_path / "tied.Q5_K.gguf"
    write_tiny_gguf(path, GGMLQuantizationType.Q5_K, tiny_model("Q5_K", tied=True))
    engine = engine_of(path)
    embedding, head = engine.model.embed_tokens, engine.model.lm_head
    assert isinstance(embedding, BlockEmbedding) and isinstance(head, BlockLinear)
    ((_, head_weight),) = head.segments
    assert head_weight.blocks.data_ptr() == embedding.blocks.data_ptr() and head_weight.kind == "Q5_K"
    assert_greedy_equals_transformers(path, seed=11)


@pytest.mark.parametrize("kind", NEW_TYPES)
def test_embedding_lookup_dequantizes_only_its_rows(kind: str):
    cols = 2 * BLOCK_LAYOUTS[kind].weights
    blocks = torch.from_numpy(random_blocks(kind, 40, cols, 0.1, seed=3))
    embedding = BlockEmbedding(BlockWeight(blocks, cols, kind), torch.float32)
    ids = torch.tensor([[3, 39, 0], [3, 17, 5]])
    assert torch.equal(embedding(ids), dequantize(blocks, kind, cols)[ids])


def test_layer_runs_each_segment_by_its_type(extension):
    """A fused layer of Q8_0, Q4_K and Q6_K segments (q/k rows permuted), within fp32 rounding of float64
    on the dequantized weights: with the real extension (Q8_0's GEMV; the others on `linear_gguf_gemv`
    where built, the torch reference otherwise) and without one."""
    cols = 256
    parts = [("Q8_0", 24), ("Q4_K", 16), ("Q6_K", 8)]
    layer = BlockLinear(sum(rows for _, rows in parts), cols, None, "cpu")
    offset, weights = 0, []
    for seed, (kind, rows) in enumerate(parts):
        order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed)) if seed == 1 else None
        weight = BlockWeight(torch.from_numpy(random_blocks(kind, rows, cols, 0.05, seed)), cols, kind, order)
        layer.load_blocks(offset, weight)
        weights.append(weight.dequantize().double())
        offset += rows
    dense = torch.cat(weights)
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(9))
    _assert_fp32_accurate(layer(x), x, dense)
    layer.extension = extension
    _assert_fp32_accurate(layer(x), x, dense)


def test_other_types_run_on_the_extensions_gguf_gemv_when_it_has_one():
    """`linear_gguf_gemv(x, blocks, ggml_type, bias)` is called with GGML's number for the type."""
    calls = []

    def gemv(x, blocks, ggml_type, bias):
        calls.append(ggml_type)
        kind = {layout.ggml_type: name for name, layout in BLOCK_LAYOUTS.items()}[ggml_type]
        return x @ dequantize(blocks, kind, x.shape[1]).T

    cols = 256
    blocks = torch.from_numpy(random_blocks("Q5_K", 6, cols, 0.05, seed=4))
    layer = BlockLinear(6, cols, None, "cpu")
    layer.load_blocks(0, BlockWeight(blocks, cols, "Q5_K"))
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(1))
    expected = layer(x)
    layer.extension = SimpleNamespace(linear_gguf_gemv=gemv)
    assert torch.allclose(layer(x), expected, rtol=1e-5, atol=1e-6)
    assert calls == [GGMLQuantizationType.Q5_K.value]


@pytest.mark.parametrize("tied", [False, True])
def test_plan_counts_every_block_type_as_stored(block_files, tmp_path: Path, tied: bool):
    """Each type's bytes as stored, no fp32 weight or kernel copy for the linears that keep them."""
    path = block_files["Q4_K_M"]
    if tied:
        path = tmp_path / "tied.Q4_0.gguf"
        write_tiny_gguf(path, GGMLQuantizationType.Q4_0, tiny_model("Q4_0", tied=True))
    checkpoint = open_checkpoint(path)
    engine = engine_of(path)
    plan = check_memory(checkpoint, [("engine", engine.config)], MemoryLimit(1 << 40, "t"), None)
    (process,) = plan.processes
    stored = {}
    for tensor in checkpoint.stored:
        stored[tensor.dtype.lower()] = stored.get(tensor.dtype.lower(), 0) + tensor.nbytes
    for kind in ("q4_k", "q6_k") if not tied else ("q4_0",):
        assert process.weights[kind] == stored[kind]
    assert process.weights.get(KERNEL_COPIES, 0) == 0
    assert process.weight_bytes == held_bytes(engine)[0]


def test_fingerprints_tell_a_q4_k_m_file_from_a_q8_0_one_of_the_same_model(block_files, tmp_path: Path):
    q8_0 = tmp_path / "tiny.Q8_0.gguf"
    write_tiny_gguf(q8_0, GGMLQuantizationType.Q8_0, tiny_model("Q4_K"))
    assert model_fingerprint(block_files["Q4_K_M"]) != model_fingerprint(q8_0)
    assert model_fingerprint(block_files["Q4_K_M"]) == model_fingerprint(block_files["Q4_K_M"])


def test_a_type_still_unread_is_refused_in_one_line(tmp_path: Path):
    path = tmp_path / "tiny.Q2_K.gguf"
    write_tiny_gguf(path, GGMLQuantizationType.Q2_K, tiny_model("Q4_K"))
    with pytest.raises(
        UnsupportedWeightTypeError, match="holds Q2_K tensors: tandem reads GGUF weights in"
    ) as info:
        open_checkpoint(path)
    assert "\n" not in str(info.value) and "Q4_K" in str(info.value)


def test_gemma3_tensors_get_gemmas_names_and_norms_without_the_added_one(tmp_path: Path):
    """llama.cpp's converter stores Gemma's RMSNorm weights plus 1 and names its four norms a layer its
    own way; q/k rows are not permuted for Gemma (the real file's serving is in test_gguf_real_files)."""
    path = tmp_path / "gemma3-tensors.gguf"
    norm = np.linspace(0.5, 2.0, 64, dtype=np.float32)
    query = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    writer = gguf.GGUFWriter(str(path), "gemma3")
    for part in ("attn_norm", "attn_q_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
        writer.add_tensor(f"blk.0.{part}.weight", norm)
    writer.add_tensor("output_norm.weight", norm)
    writer.add_tensor(
        "blk.0.attn_q.weight",
        gguf.quants.quantize(query, GGMLQuantizationType.Q4_0),
        raw_dtype=GGMLQuantizationType.Q4_0,
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors = dict(GgufCheckpoint(path, SimpleNamespace()).tensors())
    assert set(tensors) == {
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.pre_feedforward_layernorm.weight",
        "model.layers.0.post_feedforward_layernorm.weight",
        "model.norm.weight",
        "model.layers.0.self_attn.q_proj.weight",
    }
    for name, tensor in tensors.items():
        if name.endswith("norm.weight"):
            assert torch.equal(tensor, torch.from_numpy(norm) - 1)
    q_proj = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q_proj.kind == "Q4_0" and q_proj.out_order is None
