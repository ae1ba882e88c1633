"""What a command's processes will hold once the model is loaded, known before any weight is read, and a
refusal, naming the flags that would make it fit, when that exceeds the memory this machine allows.

Issue 55: an 8 B checkpoint served in int8 grew past 20 GiB while loading and was killed, a request sent
meanwhile got a closed connection. Every figure that decides this is known at start: the checkpoint's
headers give each tensor's stored type and shape, the engine config gives the resident type (the
dtype, the quantization method) and the KV pool, and the memory limit is the cgroup's or the machine's
(`engine.memory_limit`). So the server states the plan in one log line and refuses in one line when it
cannot fit, in seconds instead of after minutes of loading.

The weights are counted on the model itself, built on the meta device the way `engine.engine.Engine`
builds it (the family's modules, the dtype, the quantized linears, head and embedding, a tied head
shared) so every parameter and buffer has its real shape and type and no byte is allocated; on the CPU
in fp32 the C++ kernels add oneDNN's blocked copy of every full-precision linear beside its weight
(`kernels.cpu_linear`; a narrow LM head's transposed copy, `kernels.cpu_lm_head`, is as large), which
doubles an fp32 model's linears. The KV pool is sized by the engine's own rule (`ModelFacts`). Each
process adds its runtime (Python, torch, the kernels, the tokenizer, buffers of a step): measured, not
derived (`ENGINE_RUNTIME_BYTES`, `FRONT_DOOR_BYTES`).

The rule: refuse when the plan exceeds the limit, since the kernel's OOM killer ends a process past its
cgroup's limit (and past physical memory, with no swap, which is how these machines run) mid-load;
warn above `WARN_FRACTION` of it, where activations, grammars and the allocator's slack may still push it
over; warn when the plan exceeds the memory free now (`MemAvailable`), which other processes hold for a
while and may give back, so it cannot be a reason to refuse.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from base.errors import ConfigError
from base.logs import log_event
from base.settings import Settings, get_settings
from engine.checkpoint_stream import Checkpoint, StoredTensor
from engine.config import EngineConfig, ModelConfig, dtype_name
from engine.memory_limit import MemoryLimit, available_memory, memory_limit
from engine.model_facts import ModelFacts
from engine.quantization import NONE, check_supported
from kernels.gguf_blocks import BLOCK_TYPES

logger = logging.getLogger(__name__)

MIB = 1 << 20
GIB = 1 << 30
# Resident set of an engine process beside its weights and KV pool: Python, torch, the C++ kernels, the
# tokenizer and one step's buffers. A SmolLM2-135M decode core after its warm-up: 3,467 MiB resident
# with 978 MiB of weights and a 2,048 MiB pool, so 441 MiB (AMD EPYC, 2 cores).
ENGINE_RUNTIME_BYTES = 448 * MIB
# The decode tier's front door (HTTP, gRPC, tokenizer, no weights): 416 MiB resident (same host).
FRONT_DOOR_BYTES = 416 * MIB
# Above this share of the limit a start is allowed with a warning: it fits, with little to spare.
WARN_FRACTION = 0.9
# The smallest KV pool a `--kv-cache-memory` suggestion may name, in blocks.
MIN_SUGGESTED_BLOCKS = 16
# A label per resident dtype, as the plan line shows it.
TYPE_NAMES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.int8: "int8",
    torch.float8_e4m3fn: "fp8",
}
STORED_NAMES = {"F32": "fp32", "BF16": "bf16", "F16": "fp16", "I8": "int8", "F8_E4M3": "fp8"}
# Weight types held as views of the memory-mapped checkpoint, not copies: a GGUF's blocks.
MAPPED_TYPES = frozenset(kind.lower() for kind in BLOCK_TYPES)
# The weights' entry for oneDNN's blocked copies of the fp32 linears (`kernels.cpu_linear`).
KERNEL_COPIES = "fp32 kernel copies"


class ModelTooLargeError(ConfigError):
    """The model, its KV pool and the processes' runtime would not fit in the memory this machine allows;
    the message says by how much and which flags would make it fit (one line, printed by the CLI)."""


@dataclass(frozen=True)
class ProcessPlan:
    """What one process of a command will hold: weights by resident type, its KV pool and its runtime."""

    name: str
    weights: Mapping[str, int]
    kv_bytes: int
    runtime_bytes: int
    # One KV block's bytes (0 without a pool): the unit a smaller `--kv-cache-memory` is counted in.
    kv_block_bytes: int = 0

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values())

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.runtime_bytes


@dataclass(frozen=True)
class LoadPlan:
    """The plan of every process a command starts, and the checkpoint they load (bytes by stored type)."""

    model: str
    stored: Mapping[str, int]
    processes: tuple[ProcessPlan, ...]

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.runtime_bytes

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights_by_type().values())

    @property
    def kv_bytes(self) -> int:
        return sum(process.kv_bytes for process in self.processes)

    @property
    def runtime_bytes(self) -> int:
        return sum(process.runtime_bytes for process in self.processes)

    def weights_by_type(self) -> dict[str, int]:
        """Resident weight bytes of every process together, by type; weights used from the mapped file
        (`MAPPED_TYPES`) once, since the processes of one command map the same file and share its pages."""
        merged: dict[str, int] = {}
        for process in self.processes:
            for kind, nbytes in process.weights.items():
                together = max if kind in MAPPED_TYPES else sum
                merged[kind] = together((merged.get(kind, 0), nbytes))
        return merged

    def summary(self) -> str:
        """`weights 1.00 GiB: 512 MiB fp32 + 512 MiB fp32 kernel copies, KV 1.00 GiB, runtime 448 MiB`."""
        return (
            f"weights {_size(self.weight_bytes)}: {_by_type(self.weights_by_type())}, "
            f"KV {_size(self.kv_bytes)}, runtime {_size(self.runtime_bytes)}"
        )

    def log(self, limit: MemoryLimit) -> None:
        """State the plan, and the limit it is held to, in one structured log line (before the load)."""
        log_event(
            logger,
            logging.INFO,
            "memory plan",
            model=self.model,
            needs_gib=round(self.total_bytes / GIB, 2),
            limit_gib=round(limit.bytes / GIB, 2),
            limit_source=limit.source,
            weights=_by_type(self.weights_by_type()),
            kv=_size(self.kv_bytes),
            runtime=_size(self.runtime_bytes),
            processes=", ".join(f"{p.name} {_size(p.total_bytes)}" for p in self.processes),
            checkpoint=_by_type(self.stored),
        )


# One process of a command: its name and the engine config it loads the model under (None: a front door
# that loads no weights).
Role = tuple[str, EngineConfig | None]


def plan(
    model: str,
    stored: Sequence[StoredTensor],
    model_config: ModelConfig,
    roles: Sequence[Role],
    settings: Settings | None = None,
) -> LoadPlan:
    """The plan of the processes `roles` for a checkpoint whose tensors are `stored` (its headers)."""
    settings = get_settings() if settings is None else settings
    by_stored: dict[str, int] = {}
    for tensor in stored:
        kind = STORED_NAMES.get(tensor.dtype, tensor.dtype.lower())
        by_stored[kind] = by_stored.get(kind, 0) + tensor.nbytes
    processes = tuple(
        ProcessPlan(name, {}, 0, FRONT_DOOR_BYTES)
        if config is None
        else ProcessPlan(
            name,
            resident_weights(model_config, config, settings, stored),
            kv_pool_bytes(model_config, config),
            ENGINE_RUNTIME_BYTES,
            config.cache.block_bytes(model_config, config.kv_dtype),
        )
        for name, config in roles
    )
    return LoadPlan(model, by_stored, processes)


def resident_weights(
    model_config: ModelConfig, config: EngineConfig, settings: Settings, stored: Sequence[StoredTensor] = ()
) -> dict[str, int]:
    """Bytes the engine's model holds by type once loaded under `config` (module docstring). A GGUF's
    block-quantized tensors bound for a full-precision linear or embedding stay as stored
    (`CausalLM.block_owner`): that module counts its blocks, by type, not its dtype's weight, and gets no
    kernel copy."""
    model = meta_model(model_config, config)
    as_stored: dict[int, nn.Module] = {}
    block_bytes: dict[str, int] = {}
    for tensor in stored:
        name = model.checkpoint_name(tensor.name) if tensor.dtype in BLOCK_TYPES else None
        owner = None if name is None else model.block_owner(model.fused_name(name)[0])
        if owner is not None:
            # A w8a8 linear (`--quantization w8a8_int8`) holds int8 rows and scales until blocks replace them.
            replaced = (owner.weight,) if hasattr(owner, "weight") else (owner.qweight, owner.scale)
            as_stored.update((id(kept), owner) for kept in replaced)
            kind = tensor.dtype.lower()
            block_bytes[kind] = block_bytes.get(kind, 0) + tensor.nbytes
    storages: dict[int, tuple[torch.dtype, int]] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        # Meta tensors have no address: a tied weight is the same tensor object, so its id identifies it.
        if id(tensor) not in as_stored:
            storages[id(tensor)] = (tensor.dtype, tensor.numel() * tensor.element_size())
    by_type = dict(block_bytes)
    for dtype, nbytes in storages.values():
        kind = TYPE_NAMES.get(dtype, dtype_name(dtype))
        by_type[kind] = by_type.get(kind, 0) + nbytes
    if _kernel_copies(config, settings):
        linears = [
            m
            for m in model.modules()
            if type(m) is nn.Linear and m.weight.dtype == torch.float32 and id(m.weight) not in as_stored
        ]
        by_type[KERNEL_COPIES] = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    return by_type


def meta_model(model_config: ModelConfig, config: EngineConfig) -> nn.Module:
    """The engine's model for `config` on the meta device: its modules, dtype and quantized layers as
    `Engine.__init__` builds them, before the CPU kernels are handed in, holding no memory."""
    from engine import quantized_layers
    from engine.models import build_model
    from kernels.backend import TorchBackend
    from kernels.platform import Platform

    with torch.device("meta"):
        model = build_model(model_config, TorchBackend(None)).to(config.dtype)
    if model_config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    platform = Platform(
        device=torch.device("meta"),
        attention=TorchBackend(None),
        extension=None,
        quantized_linear=quantized_layers.linear_module(config.quantization),
        quantized_embedding=quantized_layers.embedding_module(config.quantization),
        cpu_linears=False,
        cpu_lm_head=False,
        decode_stack=False,
    )
    # The platform says at INFO what it quantized; the engine's load says it again, for real.
    platform_logger = logging.getLogger("kernels.platform")
    was_disabled, platform_logger.disabled = platform_logger.disabled, True
    try:
        platform.quantize_linears(model.layers)
        platform.quantize_embeddings(model)
    finally:
        platform_logger.disabled = was_disabled
    return model


def kv_pool_bytes(model_config: ModelConfig, config: EngineConfig) -> int:
    """Bytes of the KV pool the engine allocates under `config` (its blocks, by the engine's own rule)."""
    blocks = ModelFacts.of(model_config, config, None, "").num_blocks
    return blocks * config.cache.block_bytes(model_config, config.kv_dtype)


def _kernel_copies(config: EngineConfig, settings: Settings) -> bool:
    """Whether fp32 linears get the CPU kernels' blocked copy (`kernels.platform.choose_platform`'s
    rule; the C++ extension is assumed to build, as it does wherever a compiler is)."""
    from kernels import cpu_linear

    on_cpu = torch.device(config.device).type == "cpu"
    return on_cpu and config.dtype == torch.float32 and settings.onednn_linear and cpu_linear.available()


def check_memory(
    checkpoint: Checkpoint,
    roles: Sequence[Role],
    limit: MemoryLimit | None = None,
    available: int | None = None,
    settings: Settings | None = None,
) -> LoadPlan:
    """Plan the processes `roles` for `checkpoint` (its headers only), log the plan, and raise
    ModelTooLargeError when it exceeds `limit` (default: `memory_limit()`), naming the flags that would
    make it fit; warn when it comes within `WARN_FRACTION` of the limit or exceeds the memory `available`
    now (default: `MemAvailable`). Returns the plan."""
    limit = memory_limit() if limit is None else limit
    available = available_memory() if available is None else available
    model_config = ModelConfig.from_hf(checkpoint.config)
    stored = checkpoint.stored

    def build(change: Callable[[EngineConfig], EngineConfig]) -> LoadPlan:
        changed = [(name, None if config is None else change(config)) for name, config in roles]
        return plan(checkpoint.path.name, stored, model_config, changed, settings)

    load_plan = build(lambda config: config)
    load_plan.log(limit)
    total = load_plan.total_bytes
    if total <= WARN_FRACTION * limit.bytes:
        if available is not None and total > available:
            log_event(
                logger,
                logging.WARNING,
                "memory plan exceeds the memory free now",
                needs_gib=round(total / GIB, 2),
                available_gib=round(available / GIB, 2),
                hint="other processes hold it; the load may be killed if they keep it",
            )
        return load_plan
    configs = [config for _, config in roles if config is not None]
    cure = _cure(_alternatives(build, configs, load_plan, limit), limit)
    if total > limit.bytes:
        count = len(load_plan.processes)
        raise ModelTooLargeError(
            f"{load_plan.model} needs {_size(total)} in {count} process{'es' if count > 1 else ''} "
            f"({load_plan.summary()}) but this machine allows {_size(limit.bytes)} ({limit.source}): {cure}"
        )
    log_event(
        logger,
        logging.WARNING,
        "memory plan near the limit",
        needs_gib=round(total / GIB, 2),
        limit_gib=round(limit.bytes / GIB, 2),
        limit_source=limit.source,
        cure=cure,
    )
    return load_plan


def _alternatives(
    build: Callable[[Callable[[EngineConfig], EngineConfig]], LoadPlan],
    configs: Sequence[EngineConfig],
    base: LoadPlan,
    limit: MemoryLimit,
) -> dict[str, LoadPlan]:
    """The plans of the flags a refusal may name: `--quantization int8` (fp32 on the CPU), `--dtype
    bfloat16` (fp32, unquantized), and a `--kv-cache-memory` that brings a plan within `WARN_FRACTION` of
    `limit`, alone and beside each of the others. `build(change)` plans the command with each engine
    config passed through `change`."""
    changes: dict[str, Callable[[EngineConfig], EngineConfig]] = {"": lambda config: config}
    if all(c.quantization == NONE and c.dtype == torch.float32 and _runs_int8(c) for c in configs):
        changes["--quantization int8"] = lambda config: dataclasses.replace(config, quantization="int8")
    if all(c.quantization == NONE and c.dtype == torch.float32 for c in configs):
        changes["--dtype bfloat16"] = lambda config: dataclasses.replace(config, dtype=torch.bfloat16)
    found: dict[str, LoadPlan] = {}
    for flags, change in changes.items():
        candidate = base if not flags else build(change)
        if flags:
            found[flags] = candidate
        budget = _kv_budget(candidate, limit)
        if budget is not None:
            sized = build(
                lambda config, change=change, budget=budget: _with_kv_budget(change(config), budget)
            )
            found[f"{flags} --kv-cache-memory {budget // MIB}MiB".strip()] = sized
    return found


def _runs_int8(config: EngineConfig) -> bool:
    try:
        check_supported("int8", config.device, config.dtype)
    except ConfigError:
        return False
    return True


def _kv_budget(candidate: LoadPlan, limit: MemoryLimit) -> int | None:
    """Bytes of KV pool per engine process (whole MiB) that bring `candidate` within `WARN_FRACTION` of
    the limit, else (the rest leaves too little for that) within the limit; None when it fits already,
    or when the pool left would hold under `MIN_SUGGESTED_BLOCKS` blocks."""
    engines = [p for p in candidate.processes if p.kv_bytes]
    if not engines or candidate.total_bytes <= WARN_FRACTION * limit.bytes:
        return None
    smallest = MIN_SUGGESTED_BLOCKS * max(p.kv_block_bytes for p in engines)
    for target in (WARN_FRACTION * limit.bytes, limit.bytes):
        room = target - (candidate.total_bytes - candidate.kv_bytes)
        budget = int(room // len(engines)) // MIB * MIB
        if budget >= smallest:
            return budget
    return None


def _with_kv_budget(config: EngineConfig, budget: int) -> EngineConfig:
    cache = dataclasses.replace(config.cache, memory_bytes=budget, num_blocks=None, fit_to_sequences=False)
    return dataclasses.replace(config, cache=cache)


def _cure(alternatives: Mapping[str, LoadPlan], limit: MemoryLimit) -> str:
    """`try --quantization int8 (≈8.10 GiB) or --dtype bfloat16 (≈15.20 GiB)`: the fitting alternatives,
    smallest change first (fewest flags, then the largest plan that fits), or what the smallest needs."""
    fitting = [(flags, p.total_bytes) for flags, p in alternatives.items() if p.total_bytes <= limit.bytes]
    fitting.sort(key=lambda item: (item[0].count("--"), -item[1]))
    minimal: list[tuple[str, int]] = []
    for flags, total in fitting:
        names = _flag_names(flags)
        if not any(_flag_names(kept) < names for kept, _ in minimal):
            minimal.append((flags, total))
    if minimal:
        named = [f"{flags} (≈{_size(total)})" for flags, total in minimal[:3]]
        return "try " + (" or ".join(named) if len(named) < 3 else f"{named[0]}, {named[1]} or {named[2]}")
    if not alternatives:
        return "no flag of this server makes it fit; serve it where more memory is allowed"
    flags, total = min(alternatives.items(), key=lambda item: item[1].total_bytes)
    return f"even {flags} needs ≈{_size(total.total_bytes)}; serve it where more memory is allowed"


def _flag_names(flags: str) -> frozenset[str]:
    """The flags named in `flags` without their values: `--kv-cache-memory 1MiB` is `{--kv-cache-memory}`."""
    return frozenset(word for word in flags.split() if word.startswith("--"))


def _by_type(by_type: Mapping[str, int]) -> str:
    """`512 MiB fp32 + 129 MiB int8`, leaving out empty types."""
    return " + ".join(f"{_size(nbytes)} {kind}" for kind, nbytes in by_type.items() if nbytes) or "none"


def _size(nbytes: int) -> str:
    """GiB with two decimals from 1 GiB up, whole MiB below, KiB under a MiB (tiny test models)."""
    if nbytes >= GIB:
        return f"{nbytes / GIB:.2f} GiB"
    return f"{nbytes / MIB:.0f} MiB" if nbytes >= MIB else f"{nbytes / 1024:.0f} KiB"
