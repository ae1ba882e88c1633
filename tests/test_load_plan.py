"""The memory plan matches what the engine holds, refuses before a weight is read, and load progress shows
when it should.

The estimate is checked against the bytes of the engine's own tensors (parameters, buffers, the CPU
kernels' copies, the KV pool), never against RSS, so it is deterministic; the progress reporter runs on
an injected clock. Nothing here asserts a duration.
"""

from __future__ import annotations

import io
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from tiny_gguf import tiny_gguf_llama, write_tiny_gguf

from engine.checkpoint_stream import Checkpoint
from engine.checkpoints import open_checkpoint
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.load_plan import (
    ENGINE_RUNTIME_BYTES,
    FRONT_DOOR_BYTES,
    KERNEL_COPIES,
    ModelTooLargeError,
    check_memory,
)
from engine.load_progress import LOG_INTERVAL_S, QUIET_S, LoadProgress
from engine.memory_limit import MemoryLimit, available_memory, memory_limit
from tandem.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-plan"))


def engine_config(
    quantization: str = "none", dtype: torch.dtype = torch.float32, **cache: object
) -> EngineConfig:
    sizing = {"block_size": 16, "memory_bytes": 4 * MIB, "fit_to_sequences": True, **cache}
    return EngineConfig(quantization=quantization, dtype=dtype, cache=CacheConfig(**sizing), max_num_seqs=4)


def held_bytes(engine: Engine) -> tuple[int, int]:
    """(weights, KV) bytes the engine's tensors hold: every parameter, buffer and tensor a module keeps
    (oneDNN's blocked weights are opaque: counted by their elements), each storage once."""
    storages: dict[int, int] = {}
    for module in engine.model.modules():
        tensors = [*module._parameters.values(), *module._buffers.values()]
        tensors += [value for value in vars(module).values() if isinstance(value, torch.Tensor)]
        # A Q8_0 linear's blocks (views of the mapped GGUF; the q/k row orders beside them are not counted).
        tensors += [weight.blocks for _, weight in getattr(module, "segments", [])]
        for tensor in tensors:
            if tensor is None:
                continue
            if tensor.is_mkldnn or tensor.layout != torch.strided or _opaque(tensor):
                storages[id(tensor)] = tensor.numel() * tensor.element_size()
            else:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    kv = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in engine.kv_cache.k}
    kv |= {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in engine.kv_cache.v}
    return sum(storages.values()), sum(kv.values())


def _opaque(tensor: torch.Tensor) -> bool:
    try:
        tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return True
    return False


@pytest.mark.parametrize(
    ("quantization", "dtype"), [("none", torch.float32), ("int8", torch.float32), ("none", torch.bfloat16)]
)
def test_plan_matches_the_engine_it_describes(tiny_dir: Path, quantization: str, dtype: torch.dtype):
    config = engine_config(quantization, dtype)
    checkpoint = open_checkpoint(tiny_dir)
    plan = check_memory(checkpoint, [("engine", config)], limit=MemoryLimit(1 << 40, "test"), available=None)
    engine = Engine.from_pretrained(tiny_dir, config)
    weights, kv = held_bytes(engine)
    (process,) = plan.processes
    # The plan counts the very tensors the engine builds: equal to the byte (SmolLM2-135M too: 1,075,979,520
    # bytes in fp32 with the kernels' copies, 135,439,104 in int8).
    assert process.weight_bytes == weights
    assert process.kv_bytes == kv
    assert process.runtime_bytes == ENGINE_RUNTIME_BYTES
    assert ("int8" in process.weights) == (quantization == "int8")
    if quantization == "none" and engine.platform.cpu_linears:
        assert process.weights[KERNEL_COPIES] > 0
    if dtype == torch.bfloat16:
        # The bf16 kernels read the weights as loaded: no second copy beside them.
        assert set(process.weights) == {"bf16"}


@pytest.mark.parametrize("tied", [False, True])
def test_plan_counts_a_q8_0_gguf_as_stored(tmp_path: Path, tied: bool):
    """Q8_0 linears hold their blocks (no fp32 weight, no kernel copy); a tied head, read through the
    embedding, is dequantized into it. Without this an 8 B Q8_0 GGUF was planned as 60 GB and refused."""
    path = tmp_path / "tiny-q8_0.gguf"
    write_tiny_gguf(path, GGMLQuantizationType.Q8_0, tiny_gguf_llama(tie_word_embeddings=tied))
    config = engine_config()
    plan = check_memory(
        open_checkpoint(path), [("engine", config)], limit=MemoryLimit(1 << 40, "t"), available=None
    )
    engine = Engine.from_pretrained(path, config)
    weights, kv = held_bytes(engine)
    (process,) = plan.processes
    assert process.weight_bytes == weights
    assert process.kv_bytes == kv
    assert process.weights["q8_0"] > 0


def test_processes_of_one_command_count_a_mapped_gguf_once(tmp_path: Path):
    """Both tiers of `tandem up` map one Q8_0 file: its pages are resident once, whatever each process's
    own RSS says (the bench's PSS: 12.6 GiB for an 8 B pair whose RSS sum was 20.1)."""
    path = tmp_path / "pair.Q8_0.gguf"
    write_tiny_gguf(path, GGMLQuantizationType.Q8_0)
    config = engine_config()
    roles = [("prefill", config), ("decode core", config), ("decode front door", None)]
    plan = check_memory(open_checkpoint(path), roles, limit=MemoryLimit(1 << 40, "t"), available=None)
    prefill, core, front = plan.processes
    assert prefill.weights["q8_0"] == core.weights["q8_0"] > 0
    assert plan.weights_by_type()["q8_0"] == core.weights["q8_0"]
    assert plan.weights_by_type()["fp32"] == prefill.weights["fp32"] + core.weights["fp32"]
    each = prefill.total_bytes + core.total_bytes + front.total_bytes
    assert plan.total_bytes == each - core.weights["q8_0"]


def test_plan_counts_each_process_of_the_command(tiny_dir: Path):
    config = engine_config()
    checkpoint = open_checkpoint(tiny_dir)
    roles = [("prefill", config), ("decode core", config), ("decode front door", None)]
    plan = check_memory(checkpoint, roles, limit=MemoryLimit(1 << 40, "test"), available=None)
    prefill, core, front = plan.processes
    assert prefill.total_bytes == core.total_bytes
    assert front.weight_bytes == 0 and front.kv_bytes == 0 and front.runtime_bytes == FRONT_DOOR_BYTES
    assert plan.total_bytes == 2 * core.total_bytes + FRONT_DOOR_BYTES


def test_refusal_names_the_flags_and_reads_no_weight(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch):
    def never(self: Checkpoint):
        raise AssertionError("a weight was read before the plan was checked")

    monkeypatch.setattr(Checkpoint, "tensors", never)
    checkpoint = open_checkpoint(tiny_dir)
    big_pool = engine_config(memory_bytes=256 * MIB, fit_to_sequences=False)
    base = check_memory(
        checkpoint, [("engine", big_pool)], limit=MemoryLimit(1 << 40, "test"), available=None
    )
    # A limit the weights and runtime fit in with room, but not the 256 MiB pool.
    limit = MemoryLimit(base.total_bytes - 32 * MIB, "fake cgroup")
    with pytest.raises(ModelTooLargeError) as refused:
        check_memory(checkpoint, [("engine", big_pool)], limit=limit, available=None)
    message = str(refused.value)
    assert "\n" not in message
    assert "fake cgroup" in message and "--kv-cache-memory" in message
    assert "needs" in message and "allows" in message


def test_refusal_offers_quantization_and_dtype_when_weights_are_in_the_way(tiny_dir: Path):
    checkpoint = open_checkpoint(tiny_dir)
    config = engine_config()
    base = check_memory(checkpoint, [("engine", config)], limit=MemoryLimit(1 << 40, "test"), available=None)
    # Too small for fp32 weights and their kernel copies, large enough for int8 or bf16 ones.
    limit = MemoryLimit(base.total_bytes - base.weight_bytes // 2, "fake cgroup")
    with pytest.raises(ModelTooLargeError) as refused:
        check_memory(checkpoint, [("engine", config)], limit=limit, available=None)
    assert "--quantization int8" in str(refused.value) and "--dtype bfloat16" in str(refused.value)


def test_a_plan_near_the_limit_or_above_free_memory_warns(tiny_dir: Path, caplog: pytest.LogCaptureFixture):
    checkpoint = open_checkpoint(tiny_dir)
    config = engine_config()
    base = check_memory(checkpoint, [("engine", config)], limit=MemoryLimit(1 << 40, "test"), available=None)
    with caplog.at_level(logging.WARNING, logger="engine.load_plan"):
        check_memory(checkpoint, [("engine", config)], MemoryLimit(base.total_bytes + MIB, "x"), None)
        check_memory(checkpoint, [("engine", config)], MemoryLimit(1 << 40, "x"), base.total_bytes - 1)
    events = [record.event for record in caplog.records]
    assert events == ["memory plan near the limit", "memory plan exceeds the memory free now"]


def test_cli_refuses_in_one_line_and_exits_1(tiny_dir: Path):
    """A pool no machine holds: `tandem serve decode` says so in one line, before loading anything."""
    command = [sys.executable, "-m", "tandem.cli", "serve", "decode", "--model", str(tiny_dir)]
    command += ["--kv-cache-memory", "64TiB", "--port", "0", "--http-port", "0", "--metrics-port", "0"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, done.stderr
    assert "--kv-cache-memory" in errors[0] and "allows" in errors[0]
    assert "checkpoint streamed" not in done.stderr and "engine ready" not in done.stderr


def write_cgroup(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_memory_limit_takes_the_tightest_cgroup_on_the_path(tmp_path: Path):
    root = write_cgroup(
        tmp_path,
        {
            "proc/self/cgroup": "0::/pod/app\n",
            "sys/fs/cgroup/memory.max": "max\n",
            "sys/fs/cgroup/pod/memory.max": "8589934592\n",
            "sys/fs/cgroup/pod/app/memory.max": "max\n",
            "proc/meminfo": "MemTotal: 100 kB\nMemAvailable:    2048 kB\n",
        },
    )
    limit = memory_limit(root, physical=16 << 30)
    assert limit.bytes == 8 << 30 and "pod/memory.max" in limit.source
    assert available_memory(root) == 2048 * 1024


def test_memory_limit_reads_v1_and_ignores_its_unlimited_value(tmp_path: Path):
    limited = write_cgroup(
        tmp_path / "limited",
        {
            "proc/self/cgroup": "4:memory:/job\n0::/\n",
            "sys/fs/cgroup/memory/job/memory.limit_in_bytes": "4294967296\n",
        },
    )
    assert memory_limit(limited, physical=16 << 30).bytes == 4 << 30
    unlimited = write_cgroup(
        tmp_path / "unlimited",
        {
            "proc/self/cgroup": "4:memory:/\n",
            "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712",
        },
    )
    assert memory_limit(unlimited, physical=16 << 30) == MemoryLimit(16 << 30, "physical memory")
    # A cgroup limit above physical memory is no limit.
    above = write_cgroup(tmp_path / "above", {"sys/fs/cgroup/memory.max": str(32 << 30)})
    assert memory_limit(above, physical=16 << 30).source == "physical memory"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_short_load_shows_nothing(caplog: pytest.LogCaptureFixture):
    clock, stream = FakeClock(), FakeTerminal()
    progress = LoadProgress("loading m", 10, 10 * MIB, clock=clock, stream=stream)
    with caplog.at_level(logging.INFO, logger="engine.load_progress"):
        for _ in range(10):
            clock.now += (QUIET_S - 0.5) / 10
            progress.advance(1, MIB)
        progress.finish()
    assert stream.getvalue() == "" and not caplog.records


def test_a_terminal_gets_one_line_redrawn_in_place():
    clock, stream = FakeClock(), FakeTerminal()
    progress = LoadProgress("loading m", 4, 4 * MIB, clock=clock, stream=stream)
    clock.now += QUIET_S
    progress.advance(1, MIB)
    progress.advance(1, MIB)  # same instant: not redrawn
    clock.now += 1.0
    progress.advance(1, MIB)
    progress.advance(1, MIB)
    progress.finish()
    text = stream.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n") and text.count("\n") == 1
    assert text.rsplit("\r", 1)[1].startswith("\033[Kloading m: 4/4 tensors, 4/4 MiB")


def test_elsewhere_a_log_line_every_interval(caplog: pytest.LogCaptureFixture):
    clock, stream = FakeClock(), io.StringIO()
    progress = LoadProgress("loading m", 100, 100 * MIB, clock=clock, stream=stream)
    with caplog.at_level(logging.INFO, logger="engine.load_progress"):
        for _ in range(100):
            clock.now += LOG_INTERVAL_S / 10
            progress.advance(1, MIB)
        progress.finish()
    lines = [record for record in caplog.records if record.event == "load progress"]
    assert len(lines) == 10
    assert stream.getvalue() == ""
    first = lines[0]
    assert first.tensors == 10 and first.total_tensors == 100
    assert first.mib_per_s == pytest.approx(2.0) and first.seconds_left == pytest.approx(45.0)


def test_up_refuses_both_tiers_together_before_starting_either(tiny_dir: Path):
    """Each tier's pool fits alone; the prefill tier, decode core and front door together do not."""
    limit_gib = memory_limit().bytes / (1 << 30)
    pool = f"{int(limit_gib * 0.6 * 1024)}MiB"
    command = [sys.executable, "-m", "tandem.cli", "up", "--model", str(tiny_dir), "--kv-cache-memory", pool]
    command += ["--metrics-port", "0", "--prefill-metrics-port", "0", "--no-status"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "in 3 processes" in errors[0] and "--kv-cache-memory" in errors[0]
    assert "tier started" not in done.stderr
