"""Checkpoints stream into the model: no full-precision copy of the checkpoint at load, same weights.

The memory test loads a random bf16 Llama of ~225 MB (two shards, a 32k vocabulary) in a fresh process,
in fp32 and in int8, and asserts that the load's peak resident set grows by no more than the model it
builds (its parameters and buffers), its KV pool, and a margin of one checkpoint tensor in fp32 plus
64 MiB. Reading the checkpoint into a dict first, as the loader once did, needs the whole checkpoint in
fp32 on top of the model and fails it. The C++ kernels are switched off there: oneDNN's blocked copy of
every fp32 linear (`kernels.cpu_linear`) is the platform's resident model, not the loader's, and is not
among the parameters the bound counts.

The parity tests load tiny checkpoints of every family from disk (several shards, one of them bf16)
and compare the engine's weights, full precision and quantized, bit for bit with those the same model
gets from an in-memory state dict (the path the family parity tests hold to transformers' tokens), and
its greedy tokens with that engine's.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import engine_for, random_prompts
from safetensors.torch import save_file
from test_model_families import CONFIGS, hf_model
from test_moe_families import tiny_moe
from tiny_tokenizer import build_tiny_tokenizer
from transformers import LlamaConfig

from engine.checkpoints import open_checkpoint
from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.engine import Engine, GenerateRequest
from engine.params import SamplingParams, StoppingParams

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
# A Llama whose checkpoint is ~225 MB in bf16 (~113 M parameters), most of it the untied embedding and
# head (32768 x 1024, 128 MiB each in fp32): big enough that a second copy cannot hide in the margin.
BIG_LLAMA = dict(
    vocab_size=32768,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=128,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
MARGIN_BYTES = 64 * MIB

# Run in a fresh process: the peak resident set (VmHWM) is reset once the imports and the tokenizer are
# in, then the engine loads; prints what the bound needs as JSON.
LOAD_SCRIPT = """
import json, re, sys
from pathlib import Path
import torch
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.model_store import load_hf_config
from engine.tokenizer import Tokenizer

def status_kib(key):
    return int(re.search(key + r":\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1))

model_dir, quantization = Path(sys.argv[1]), sys.argv[2]
load_hf_config(model_dir)
Tokenizer.from_pretrained(model_dir)
Path("/proc/self/clear_refs").write_text("5")
before = status_kib("VmRSS")
config = EngineConfig(quantization=quantization, cache=CacheConfig(block_size=16, num_blocks=16))
engine = Engine.from_pretrained(model_dir, config)
peak = status_kib("VmHWM")
storages = {}
for tensor in [*engine.model.parameters(), *engine.model.buffers()]:
    storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
kv = sum(t.nbytes for t in {id(t): t for t in [*engine.kv_cache.k, *engine.kv_cache.v]}.values())
print(json.dumps({"growth": (peak - before) * 1024, "model": sum(storages.values()), "kv": kv}))
"""


@pytest.fixture(scope="module")
def big_bf16_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The random bf16 Llama of `BIG_LLAMA`, in two shards (layers in one, embedding and head in the
    other), with the tiny tokenizer."""
    directory = tmp_path_factory.mktemp("big-bf16")
    config = LlamaConfig(**BIG_LLAMA)
    config.save_pretrained(directory)
    build_tiny_tokenizer(directory)
    generator = torch.Generator().manual_seed(0)
    hidden, inter, kv = config.hidden_size, config.intermediate_size, config.num_key_value_heads * 128

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    layers = {}
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj.weight": (hidden, hidden),
            "self_attn.k_proj.weight": (kv, hidden),
            "self_attn.v_proj.weight": (kv, hidden),
            "self_attn.o_proj.weight": (hidden, hidden),
            "mlp.gate_proj.weight": (inter, hidden),
            "mlp.up_proj.weight": (inter, hidden),
            "mlp.down_proj.weight": (hidden, inter),
        }
        layers |= {prefix + name: weight(*shape) for name, shape in shapes.items()}
        layers[prefix + "input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        layers[prefix + "post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    save_file(layers, str(directory / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    del layers
    vocabulary = {
        "model.embed_tokens.weight": weight(config.vocab_size, hidden),
        "lm_head.weight": weight(config.vocab_size, hidden),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
    }
    save_file(vocabulary, str(directory / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    return directory


def load_in_fresh_process(model_dir: Path, quantization: str) -> dict[str, int]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TANDEM_CPU_EXTENSION="0", TANDEM_ONEDNN_LINEAR="0")
    completed = subprocess.run(
        [sys.executable, "-c", LOAD_SCRIPT, str(model_dir), quantization],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_load_peaks_at_the_resident_model(big_bf16_checkpoint: Path, quantization: str):
    checkpoint_bytes = sum(p.stat().st_size for p in big_bf16_checkpoint.glob("*.safetensors"))
    largest_fp32 = BIG_LLAMA["vocab_size"] * BIG_LLAMA["hidden_size"] * 4
    measured = load_in_fresh_process(big_bf16_checkpoint, quantization)
    bound = measured["model"] + measured["kv"] + largest_fp32 + MARGIN_BYTES
    assert measured["growth"] <= bound, (
        f"loading grew the resident set by {measured['growth'] / MIB:.0f} MiB; the model is "
        f"{measured['model'] / MIB:.0f} MiB, its KV pool {measured['kv'] / MIB:.0f} MiB, the checkpoint "
        f"{checkpoint_bytes / MIB:.0f} MiB of bf16 ({2 * checkpoint_bytes / MIB:.0f} MiB in fp32)"
    )


def save_checkpoint(model: torch.nn.Module, directory: Path) -> Path:
    """`model` as transformers writes it, in shards of about 200 KB (several per tiny model)."""
    model.save_pretrained(directory, max_shard_size="200KB")
    assert len(list(directory.glob("*.safetensors"))) > 1
    return directory


def streamed_engine(model_dir: Path, quantization: str) -> Engine:
    checkpoint = open_checkpoint(model_dir)
    config = EngineConfig(quantization=quantization, cache=CacheConfig(block_size=8, num_blocks=64))
    return Engine(ModelConfig.from_hf(checkpoint.config), checkpoint.tensors(), None, config)


def assert_same_model(streamed: Engine, in_memory: Engine) -> None:
    """Equal weights bit for bit (quantized rows and scales too), and equal greedy tokens."""
    expected = in_memory.model.state_dict()
    loaded = streamed.model.state_dict()
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    stopping = StoppingParams(max_tokens=6, ignore_eos=True)
    requests = [
        GenerateRequest(p, SamplingParams(temperature=0.0), stopping)
        for p in random_prompts(3, seed=5, max_len=30)
    ]
    outputs = [
        [seq.output_token_ids for seq in engine.generate(copy.deepcopy(requests))]
        for engine in (streamed, in_memory)
    ]
    assert outputs[0] == outputs[1]


def in_memory_engine(hf: torch.nn.Module, quantization: str) -> Engine:
    return engine_for(hf, block_size=8, num_blocks=64, quantization=quantization, device="cpu")


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_family_streams_the_weights_a_state_dict_gives(name: str, quantization: str, tmp_path: Path):
    hf = hf_model(name)
    model_dir = save_checkpoint(hf, tmp_path)
    assert_same_model(streamed_engine(model_dir, quantization), in_memory_engine(hf, quantization))


@pytest.mark.parametrize("quantization", ["none", "int8", "w8a8_int8"])
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_experts_stream_one_tensor_at_a_time(kind: str, quantization: str, tmp_path: Path):
    """transformers writes one tensor per expert and matrix; each goes into its slot of the stacked
    experts as it streams in."""
    hf = tiny_moe(kind, seed=3)
    model_dir = save_checkpoint(hf, tmp_path)
    assert any(".experts.0." in name for name in open_checkpoint(model_dir).names)
    assert_same_model(streamed_engine(model_dir, quantization), in_memory_engine(hf, quantization))


@pytest.mark.parametrize("quantization", ["none", "int8", "w8a8_int8"])
def test_bf16_checkpoint_converts_on_the_way_in(quantization: str, tmp_path: Path):
    """A bf16 checkpoint loads into an fp32 engine as the state dict cast to fp32 first would."""
    hf = copy.deepcopy(hf_model("llama")).to(torch.bfloat16)
    model_dir = save_checkpoint(hf, tmp_path)
    assert_same_model(streamed_engine(model_dir, quantization), in_memory_engine(hf.float(), quantization))


def test_missing_and_unexpected_tensors_are_refused(tmp_path: Path):
    hf = hf_model("llama")
    model_dir = save_checkpoint(hf, tmp_path)
    checkpoint = open_checkpoint(model_dir)
    config = EngineConfig(cache=CacheConfig(block_size=8, num_blocks=8))
    model_config = ModelConfig.from_hf(checkpoint.config)
    without_norm = ((n, t) for n, t in checkpoint.tensors() if n != "model.norm.weight")
    with pytest.raises(KeyError, match="lacks parameters"):
        Engine(model_config, without_norm, None, config)
    extra = [*checkpoint.tensors(), ("model.layers.0.mlp.extra.weight", torch.zeros(4))]
    with pytest.raises(KeyError, match="has no place"):
        Engine(model_config, iter(extra), None, config)
