"""Compile every Triton kernel the backend launches for real NVIDIA GPUs, on a machine without one.

The kernel tests run under Triton's interpreter, which never compiles: it cannot see register
spills, shared memory beyond what an SM has, or `tl.dot` rules of real hardware. Triton can
compile for a GPU target without a GPU, with the `ptxas` it ships. So this tool replays what the
backend launches and compiles exactly that:

- the kernel wrappers run over `meta` tensors (free) laid out as a decoder layer lays them out
  (q/k/v views of one fused projection), for each model shape, dtype and KV-cache dtype (auto,
  int8, fp8_e4m3: a quantized cache adds its scale caches), with their launches recorded instead
  of run (`triton_common.recorded_launches`); decode attention runs over the batches and contexts
  the split planner sees, so every split count it can choose appears, and attention runs once more
  with each sliding window of `SLIDING_WINDOWS` (a window's size is a runtime scalar, so one windowed
  prefill kernel serves every size, and decode's kernels are the causal ones; a window can still
  change the split plan, hence the launches); the linears of a GGUF's Q8_0 weights (`triton_q8_0`) run
  over every decode batch and a full step budget, as `BlockLinear` lays them out (one launch per
  checkpoint tensor, llama.cpp's q/k row orders, Qwen2's qkv bias). Tile
  sizes, split plans, warps and stages are therefore the launch sites' own, never copied here;
- each distinct launch becomes what Triton's JIT would compile for it: Triton's own binder gives
  the signature, constexprs and divisibility attributes, and `triton.compile(ASTSource(...),
  target=GPUTarget("cuda", arch, 32))` compiles it;
- registers and spill bytes come from `ptxas -v` over the generated PTX (the ptxas Triton uses,
  with its flags), shared memory and warps/stages from the compiled metadata. Shared memory is
  checked against the arch's per-block limit, which only the driver would enforce at load time.

    python -m kernels.aot --arch sm_80,sm_90 [--json] [--model llama-3.1-8b] [--dtype bfloat16] \
        [--kv-cache-dtype int8]

fp8_e4m3 caches are compiled only for sm_89 and up, the GPUs the engine accepts them on.

Exits 1 when any kernel fails to compile, spills, or needs more shared memory than the arch has.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

# The kernels must be real `JITFunction`s, not interpreted ones: the decorators read this at import.
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from base.kv_dtypes import (  # noqa: E402
    KV_CACHE_DTYPE_CHOICES,
    SCALE_DTYPE,
    is_quantized,
    resolve_kv_cache_dtype,
)
from kernels import (  # noqa: E402
    triton_cache,
    triton_decode,
    triton_fused,
    triton_moe,
    triton_prefill,
    triton_q8_0,
)
from kernels.gguf_blocks import BlockWeight  # noqa: E402
from kernels.kv_quant import FP8_MIN_CUDA_CAPABILITY  # noqa: E402
from kernels.metadata import AttentionMetadata  # noqa: E402
from kernels.triton_common import KernelLaunch, is_interpreted, recorded_launches  # noqa: E402
from kernels.triton_q8_0 import BLOCK_BYTES, BLOCK_WEIGHTS  # noqa: E402

# Largest dynamic shared memory one block may opt into (CUDA programming guide, per compute capability).
MAX_SHARED_BYTES = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# Decode batches and contexts the split planner is asked about: every split count it can choose.
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DECODE_CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)
# The engine's defaults, which a server started without flags steps with: KV block size and step token
# budget (`CacheConfig.block_size`, `EngineConfig.max_num_batched_tokens`). Kernels may not import the
# engine, so they are repeated here; tests/test_kernels_aot.py checks that the two agree.
BLOCK_SIZE = 16
TOKEN_BUDGET = 512
# Sliding windows attention is also launched with: Gemma 3's local layers, and Mistral's.
SLIDING_WINDOWS = (512, 4096)


@dataclass(frozen=True)
class ModelShape:
    """The layer dimensions that decide kernel specialisations (published configs of each model)."""

    name: str
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    # Mixture-of-experts layers (0: dense): experts, experts per token, each expert's intermediate size.
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0


MODELS = (
    ModelShape("smollm2-135m", hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64),
    ModelShape("llama-3.1-8b", hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128),
    ModelShape("llama-3.1-70b", hidden=8192, intermediate=28672, heads=64, kv_heads=8, head_dim=128),
    ModelShape(
        "mixtral-8x7b",
        hidden=4096,
        intermediate=14336,
        heads=32,
        kv_heads=8,
        head_dim=128,
        experts=8,
        experts_per_token=2,
        expert_intermediate=14336,
    ),
)


@dataclass(frozen=True)
class Specialisation:
    """One compilation Triton's JIT would do: a kernel with its signature, constants and options."""

    kernel: object
    signature: dict[str, str]
    constexprs: dict[tuple[int, ...], object]
    attrs: dict[tuple[int, ...], list]
    options: dict[str, object]

    def key(self) -> str:
        constants = sorted((k, str(v)) for k, v in self.constexprs.items())
        return repr(
            (self.kernel.__name__, self.signature, constants, sorted(self.attrs.items()), self.options)
        )


@dataclass
class Result:
    """One row of the report: a kernel specialisation compiled for one arch."""

    kernel: str
    arch: str
    config: str
    constexprs: str
    compiled: bool
    registers: int | None = None
    spills: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    stack_bytes: int | None = None
    shared_bytes: int | None = None
    max_shared_bytes: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    # Divisions compiled to CUDA's approximate `div.full`/`div.approx`: harmless in attention, wrong
    # where a kernel must round exactly as its reference does (the quantizing KV write).
    approximate_divisions: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        fits = self.max_shared_bytes is None or (self.shared_bytes or 0) <= self.max_shared_bytes
        return self.compiled and self.spills == 0 and fits


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _qkv(model: ModelShape, tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q, k, v as the model makes them: views of one fused projection output."""
    q_size, kv_size = model.heads * model.head_dim, model.kv_heads * model.head_dim
    qkv = _meta(tokens, q_size + 2 * kv_size, dtype=dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (
        q.view(-1, model.heads, model.head_dim),
        k.view(-1, model.kv_heads, model.head_dim),
        v.view(-1, model.kv_heads, model.head_dim),
    )


@dataclass(frozen=True)
class Precision:
    """The model's dtype (activations, weights) and its KV cache's element dtype."""

    dtype: torch.dtype
    kv_dtype: torch.dtype


def _caches(
    model: ModelShape, num_blocks: int, block_size: int, kv_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """K and V caches, and their scale caches when `kv_dtype` is quantized (else None, None)."""
    shape = (num_blocks, block_size, model.kv_heads, model.head_dim)
    k, v = _meta(*shape, dtype=kv_dtype), _meta(*shape, dtype=kv_dtype)
    if not is_quantized(kv_dtype):
        return k, v, None, None
    return k, v, _meta(*shape[:3], dtype=SCALE_DTYPE), _meta(*shape[:3], dtype=SCALE_DTYPE)


def _layer_ops(model: ModelShape, tokens: int, block_size: int, precision: Precision) -> None:
    """Everything of a decoder layer but attention, on a step of `tokens` rows."""
    dtype = precision.dtype
    hidden = _meta(tokens, model.hidden, dtype=dtype)
    weight = _meta(model.hidden, dtype=dtype)
    triton_fused.rms_norm(hidden, weight, 1e-5)
    triton_fused.rms_norm(hidden, weight, 1e-5, _meta(tokens, model.hidden, dtype=dtype))
    q, k, v = _qkv(model, tokens, dtype)
    cos = _meta(tokens, model.head_dim, dtype=dtype)
    triton_fused.apply_rope(q, k, cos, _meta(tokens, model.head_dim, dtype=dtype))
    k_cache, v_cache, k_scales, v_scales = _caches(model, 1024, block_size, precision.kv_dtype)
    slots = _meta(tokens, dtype=torch.int64)
    triton_cache.write_kv_cache(k, v, k_cache, v_cache, slots, k_scales, v_scales)
    triton_fused.silu_and_mul(_meta(tokens, 2 * model.intermediate, dtype=dtype))


def _decode_attention(
    model: ModelShape,
    batch: int,
    context: int,
    block_size: int,
    precision: Precision,
    window: int | None = None,
) -> None:
    blocks_per_seq = triton.cdiv(context, block_size)
    q, _, _ = _qkv(model, batch, precision.dtype)
    k_cache, v_cache, k_scales, v_scales = _caches(
        model, batch * blocks_per_seq, block_size, precision.kv_dtype
    )
    tables = _meta(batch, blocks_per_seq, dtype=torch.int32)
    seq_lens = _meta(batch, dtype=torch.int32)
    scale = model.head_dim**-0.5
    triton_decode.paged_decode_attention(
        q, k_cache, v_cache, tables, seq_lens, scale, None, k_scales, v_scales, window
    )


def _prefill_attention(
    model: ModelShape, chunk: int, block_size: int, precision: Precision, window: int | None = None
) -> None:
    """A mixed step: one prompt chunk of `chunk` tokens and three single-token decodes."""
    query_lens = [chunk, 1, 1, 1]
    seq_lens = [chunk, 300, 1000, 5000]
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    blocks_per_seq = triton.cdiv(max(seq_lens), block_size)
    meta = AttentionMetadata(
        query_start_loc=_meta(len(starts), dtype=torch.int32),
        seq_lens=_meta(len(seq_lens), dtype=torch.int32),
        block_tables=_meta(len(seq_lens), blocks_per_seq, dtype=torch.int32),
        slot_mapping=_meta(starts[-1], dtype=torch.int64),
        query_lens_host=query_lens,
        seq_lens_host=seq_lens,
    )
    q, _, _ = _qkv(model, starts[-1], precision.dtype)
    k_cache, v_cache, k_scales, v_scales = _caches(model, 4 * blocks_per_seq, block_size, precision.kv_dtype)
    scale = model.head_dim**-0.5
    triton_prefill.paged_prefill_attention(q, k_cache, v_cache, meta, scale, None, k_scales, v_scales, window)


def _moe_layer(model: ModelShape, tokens: int, dtype: torch.dtype, int8: bool) -> None:
    """The expert layer of a step of `tokens` rows (`triton_moe.fused_moe`), over a plan of the size
    the step can need; int8 experts (`--quantization int8`) with their per-row scales."""
    experts, inter, pairs = model.experts, model.expert_intermediate, tokens * model.experts_per_token
    block_m = triton_moe.block_m_for(pairs)
    length = triton_moe.capacity(pairs, experts, block_m)
    plan = (
        _meta(length, dtype=torch.int32),
        _meta(length // block_m, dtype=torch.int32),
        _meta(1, dtype=torch.int32),
    )
    weight_dtype = torch.int8 if int8 else dtype
    w_gate_up = _meta(experts, 2 * inter, model.hidden, dtype=weight_dtype)
    w_down = _meta(experts, model.hidden, inter, dtype=weight_dtype)
    scales = (
        _meta(experts, 2 * inter, dtype=torch.float32),
        _meta(experts, model.hidden, dtype=torch.float32),
    )
    hidden = _meta(tokens, model.hidden, dtype=dtype)
    weights = _meta(tokens, model.experts_per_token, dtype=torch.float32)
    triton_moe.fused_moe_planned(hidden, w_gate_up, w_down, weights, plan, block_m, *(scales if int8 else ()))


def _q8_0_weight(rows: int, cols: int, ordered: bool = False) -> BlockWeight:
    """Q8_0 blocks of a `rows x cols` checkpoint tensor, with an output order when `ordered`."""
    order = _meta(rows, dtype=torch.int64) if ordered else None
    return BlockWeight(
        _meta(rows, cols // BLOCK_WEIGHTS * BLOCK_BYTES, dtype=torch.uint8), cols, "Q8_0", order
    )


def _q8_0_linears(model: ModelShape, tokens: int, dtype: torch.dtype) -> None:
    """A decoder layer's linears over a GGUF's Q8_0 blocks on a step of `tokens` rows, segment by segment
    as `BlockLinear` holds them: q, k (in llama.cpp's row order) and v of a Llama, the same with a bias
    and no order (Qwen2's), o, and gate, up and down unless the MLP is made of experts."""
    q_size, kv_size = model.heads * model.head_dim, model.kv_heads * model.head_dim
    qkv = [(0, q_size), (q_size, kv_size), (q_size + kv_size, kv_size)]
    layers = [
        (
            [(offset, _q8_0_weight(rows, model.hidden, offset < q_size + kv_size)) for offset, rows in qkv],
            None,
        ),
        (
            [(offset, _q8_0_weight(rows, model.hidden)) for offset, rows in qkv],
            _meta(q_size + 2 * kv_size, dtype=dtype),
        ),
        ([(0, _q8_0_weight(model.hidden, q_size))], None),
    ]
    if not model.experts:
        gate_up = [(0, _q8_0_weight(model.intermediate, model.hidden))]
        gate_up.append((model.intermediate, _q8_0_weight(model.intermediate, model.hidden)))
        layers += [(gate_up, None), ([(0, _q8_0_weight(model.hidden, model.intermediate))], None)]
    for segments, bias in layers:
        out_features = sum(weight.shape[0] for _, weight in segments)
        x = _meta(tokens, segments[0][1].cols, dtype=dtype)
        triton_q8_0.q8_0_layer(x, segments, out_features, bias)


def recorded_configs(
    model: ModelShape, dtype_name: str, kv_cache_dtype: str = "auto"
) -> Iterator[tuple[str, KernelLaunch]]:
    """(what step it came from, launch) for every launch the backend makes for `model` in `dtype`
    over a KV cache of `kv_cache_dtype` (a `--kv-cache-dtype` value).

    Block size and step token budget are the engine's defaults, as a server started without
    flags uses them.
    """
    dtype = DTYPES[dtype_name]
    precision = Precision(dtype, resolve_kv_cache_dtype(kv_cache_dtype, dtype))
    block_size, budget = BLOCK_SIZE, TOKEN_BUDGET
    steps = [(f"layer ops, {budget} tokens", lambda: _layer_ops(model, budget, block_size, precision))]
    steps.append(
        (
            f"prefill chunk {budget} + 3 decodes",
            lambda: _prefill_attention(model, budget, block_size, precision),
        )
    )
    for batch in DECODE_BATCHES:
        for context in DECODE_CONTEXTS:
            run = lambda b=batch, c=context: _decode_attention(model, b, c, block_size, precision)  # noqa: E731
            steps.append((f"decode batch {batch} context {context}", run))
    for tokens in (1, budget) if model.experts else ():
        for int8 in (False, True):
            run = lambda t=tokens, q=int8: _moe_layer(model, t, dtype, q)  # noqa: E731
            steps.append((f"experts, {tokens} tokens{', int8' if int8 else ''}", run))
    for tokens in (*DECODE_BATCHES, budget):
        run = lambda t=tokens: _q8_0_linears(model, t, dtype)  # noqa: E731
        steps.append((f"q8_0 linears, {tokens} tokens", run))
    context = max(DECODE_CONTEXTS)
    for window in SLIDING_WINDOWS:
        run = lambda w=window: _prefill_attention(model, budget, block_size, precision, w)  # noqa: E731
        steps.append((f"prefill chunk {budget} + 3 decodes window {window}", run))
        for batch in DECODE_BATCHES:
            run = lambda b=batch, w=window: _decode_attention(model, b, context, block_size, precision, w)  # noqa: E731
            steps.append((f"decode batch {batch} context {context} window {window}", run))
    for label, step in steps:
        with recorded_launches() as launches:
            step()
        for launch in launches:
            yield f"{model.name} {dtype_name} kv={kv_cache_dtype} {label}", launch


def kv_cache_dtypes_on(arch: int, kv_cache_dtypes: Iterable[str]) -> list[str]:
    """The `--kv-cache-dtype` values the engine accepts on `arch` (fp8 e4m3 from sm_89 on)."""
    fp8_ok = divmod(arch, 10) >= FP8_MIN_CUDA_CAPABILITY
    return [name for name in kv_cache_dtypes if fp8_ok or name != "fp8_e4m3"]


def specialise(launch: KernelLaunch, target: GPUTarget) -> Specialisation:
    """What Triton's JIT would compile for this launch on `target`, found by Triton's own binder."""
    kernel = launch.kernel
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = {**launch.constexprs, **launch.options}
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return Specialisation(kernel, signature, constexprs, attrs, options.__dict__)


_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_APPROXIMATE_DIVISION = re.compile(r"\bdiv\.(?:full|approx)\.f32\b")


def ptxas_usage(ptx: str, arch: int, options: dict[str, object]) -> tuple[int, int, int, int]:
    """(registers, stack frame bytes, spill store bytes, spill load bytes) that `ptxas -v` reports."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    fmad = [] if options.get("enable_fp_fusion", True) else ["--fmad=false"]
    with tempfile.TemporaryDirectory() as scratch:
        source = os.path.join(scratch, "kernel.ptx")
        with open(source, "w") as handle:
            handle.write(ptx)
        command = [
            get_ptxas(arch).path,
            "-v",
            *fmad,
            "--regAllocOptLevel=2",
            f"--gpu-name={sm_arch_from_capability(arch)}",
            source,
            "-o",
            os.path.join(scratch, "kernel.cubin"),
        ]
        log = subprocess.run(command, check=True, capture_output=True, text=True).stderr
    registers = _PTXAS_REGISTERS.search(log)
    spills = _PTXAS_SPILLS.search(log)
    if registers is None or spills is None:
        raise RuntimeError(f"unexpected ptxas -v output: {log}")
    stack, stores, loads = (int(g) for g in spills.groups())
    return int(registers.group(1)), stack, stores, loads


def compile_one(spec: Specialisation, arch: int, config: str) -> Result:
    target = GPUTarget("cuda", arch, 32)
    constants = {spec.kernel.arg_names[k[0]]: v for k, v in spec.constexprs.items()}
    result = Result(
        kernel=spec.kernel.__name__,
        arch=f"sm_{arch}",
        config=config,
        constexprs=", ".join(f"{k}={v}" for k, v in constants.items()),
        compiled=False,
        max_shared_bytes=MAX_SHARED_BYTES.get(arch),
    )
    try:
        source = ASTSource(spec.kernel, spec.signature, spec.constexprs, spec.attrs)
        compiled = triton.compile(source, target=target, options=spec.options)
        ptx = compiled.asm["ptx"]
        registers, stack, stores, loads = ptxas_usage(ptx, arch, spec.options)
    except Exception as exc:  # every compiler failure is a finding to report, not a crash
        result.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        return result
    result.compiled = True
    result.registers, result.stack_bytes = registers, stack
    result.spill_stores, result.spill_loads, result.spills = stores, loads, stores + loads
    result.shared_bytes = compiled.metadata.shared
    result.num_warps, result.num_stages = compiled.metadata.num_warps, compiled.metadata.num_stages
    result.approximate_divisions = len(_APPROXIMATE_DIVISION.findall(ptx))
    return result


def unique_specialisations(
    models: Iterable[ModelShape],
    dtypes: Iterable[str],
    arch: int,
    kv_cache_dtypes: Iterable[str] = ("auto",),
) -> list[tuple[Specialisation, str]]:
    """Each distinct compilation with the first step that launches it, in launch order."""
    target = GPUTarget("cuda", arch, 32)
    seen: dict[str, tuple[Specialisation, str]] = {}
    for model in models:
        for dtype_name in dtypes:
            for kv_cache_dtype in kv_cache_dtypes_on(arch, kv_cache_dtypes):
                for config, launch in recorded_configs(model, dtype_name, kv_cache_dtype):
                    spec = specialise(launch, target)
                    seen.setdefault(spec.key(), (spec, config))
    return list(seen.values())


# The compilations `run` farms out: forked workers inherit the list and are sent indices only (a
# specialisation holds its JIT function, which does not pickle).
_PENDING: list[tuple[Specialisation, int, str]] = []


def _compile_pending(index: int) -> Result:
    spec, arch, config = _PENDING[index]
    return compile_one(spec, arch, config)


def run(
    archs: Iterable[int],
    models: Iterable[ModelShape],
    dtypes: Iterable[str],
    kv_cache_dtypes: Iterable[str] = ("auto",),
    workers: int = 1,
) -> list[Result]:
    """Every compilation's result, in launch order; `workers` processes compile side by side (each
    compilation is independent and single-threaded, ptxas included)."""
    models, dtypes, kv_cache_dtypes = list(models), list(dtypes), list(kv_cache_dtypes)
    _PENDING[:] = [
        (spec, arch, config)
        for arch in archs
        for spec, config in unique_specialisations(models, dtypes, arch, kv_cache_dtypes)
    ]
    try:
        if workers <= 1 or len(_PENDING) < 2:
            return [_compile_pending(index) for index in range(len(_PENDING))]
        context = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            return list(pool.map(_compile_pending, range(len(_PENDING))))
    finally:
        _PENDING.clear()


def summary(results: list[Result]) -> list[dict]:
    """Per kernel and arch: how many specialisations, all compiled or not, worst registers/spills/shared."""
    groups: dict[tuple[str, str], list[Result]] = {}
    for result in results:
        groups.setdefault((result.kernel, result.arch), []).append(result)
    rows = []
    for (kernel, arch), group in groups.items():
        done = [r for r in group if r.compiled]
        rows.append(
            {
                "kernel": kernel,
                "arch": arch,
                "specialisations": len(group),
                "compiled": len(done),
                "max_registers": max((r.registers for r in done), default=None),
                "max_spills": max((r.spills for r in done), default=None),
                "max_shared_bytes": max((r.shared_bytes for r in done), default=None),
            }
        )
    return rows


def format_table(results: list[Result]) -> str:
    header = f"{'kernel':<22} {'arch':<6} {'regs':>5} {'spill':>6} {'shared':>7} {'warps':>5} {'stages':>6}"
    lines = [f"{header}  config"]
    for r in results:
        if not r.compiled:
            lines.append(f"{r.kernel:<22} {r.arch:<6} FAILED {r.error}  [{r.config}]")
            continue
        flag = "" if r.ok else "  <-- "
        lines.append(
            f"{r.kernel:<22} {r.arch:<6} {r.registers:>5} {r.spills:>6} {r.shared_bytes:>7} "
            f"{r.num_warps:>5} {r.num_stages:>6}  {r.config} [{r.constexprs}]{flag}"
        )
    lines.append("")
    header = f"{'kernel':<22} {'arch':<6} {'specs':>5} {'built':>5} {'max regs':>8} {'max spill':>9}"
    lines.append(f"{header} {'max shared':>10}")
    for row in summary(results):
        lines.append(
            f"{row['kernel']:<22} {row['arch']:<6} {row['specialisations']:>5} {row['compiled']:>5} "
            f"{row['max_registers']!s:>8} {row['max_spills']!s:>9} {row['max_shared_bytes']!s:>10}"
        )
    return "\n".join(lines)


def parse_arch(text: str) -> list[int]:
    archs = []
    for part in text.split(","):
        digits = part.strip().lower().removeprefix("sm_").removeprefix("sm")
        if not digits.isdigit():
            raise argparse.ArgumentTypeError(f"{part!r} is not an arch like sm_80 or sm_90")
        archs.append(int(digits))
    return archs


def _choices(known: Iterable[str]) -> Callable[[str], list[str]]:
    known = list(known)

    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",")]
        unknown = [name for name in names if name not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {', '.join(known)}")
        return names

    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=parse_arch, default=[80, 90], help="e.g. sm_80,sm_90 (default)")
    parser.add_argument("--json", action="store_true", help="print a JSON list of results")
    names = [m.name for m in MODELS]
    parser.add_argument(
        "--model",
        type=_choices(names),
        default=names,
        help=f"comma list of {', '.join(names)} (default: all)",
    )
    parser.add_argument(
        "--dtype",
        type=_choices(DTYPES),
        default=list(DTYPES),
        help="comma list (default: all of float16,bfloat16,float32)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        type=_choices(KV_CACHE_DTYPE_CHOICES),
        default=list(KV_CACHE_DTYPE_CHOICES),
        help="comma list of KV cache dtypes (default: all of auto,int8,fp8_e4m3; fp8_e4m3 on sm_89+ only)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="compilations run side by side in worker processes (default: one per CPU)",
    )
    args = parser.parse_args(argv)
    if is_interpreted(triton_decode._decode_kernel):
        parser.error("the kernels were imported under TRITON_INTERPRET=1; run this as its own process")
    models = [m for m in MODELS if m.name in args.model]
    results = run(args.arch, models, args.dtype, args.kv_cache_dtype, workers=args.jobs)
    if args.json:
        print(json.dumps([asdict(r) | {"ok": r.ok} for r in results], indent=1))
    else:
        print(format_table(results))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
