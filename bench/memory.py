"""`tandem bench memory`: every resident MiB of one idle tandem decode server, accounted for.

    tandem bench memory [--kv-cache-dtype auto] [--tokens 32768 --slots 16] [--no-llama-server]

Starts one `tandem serve decode` (aggregated: no prefill tier) on the default model with
`--quantization int8`, `--max-num-seqs` = `--slots`, `--max-model-len` = `--tokens / --slots` and no
`--kv-cache-memory`, so that its default pool holds exactly `--tokens` tokens (the defaults hold what
llama-server's `-c 32768 -np 16` holds: 32,768 tokens over 16 slots of 2,048), waits until it
is healthy, sends one warm-up chat request, waits `--settle` seconds idle, then reads
`/proc/<pid>/smaps` of the server (the front door) and of each of its children (the engine core, found
by its parent pid and named by the server's log; multiprocessing's resource tracker) and splits each
process's resident set (the sum of its mappings' Rss) into:

- the model-sized parts, in the engine core only, computed rather than measured: the weights as the
  engine stores them (from the checkpoint's tensor shapes: under int8 one byte per weight of every
  matrix plus an fp32 scale per row, norms and biases fp32, a tied embedding and LM head held once)
  and the KV pool (the "engine ready" log line's blocks x the bytes of a block of its KV dtype);
- the rest of the anonymous memory (brk heap, anonymous mmaps, stacks): "other anonymous (allocator,
  interpreter, Python objects)";
- file-backed mappings by library family: torch, oneDNN/MKL/OpenMP, python, gRPC, xgrammar,
  tokenizers, numpy, tandem's C++ kernels, system libraries, other .so files, model files, other files.

Then, where gdb can attach, it calls glibc's `malloc_trim(0)` in each process and reads smaps again:
what the RSS drops by is memory the allocator held freed. With llama.cpp built (`python -m
bench.llama_cpp_build`) it measures llama-server (`-c 32768 -np 16 -cb`) on the Q8_0 GGUF of the same
weights the same way, after the same warm-up (its f16 KV cache computed from the config, its weights
the GGUF's file pages), and prints tandem's total over llama-server's with the host
(`bench.machine.host_label`) beside it.

Writes `<out-dir>/memory.json` and prints a table per process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import re
import shutil
import struct
import subprocess
import time
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bench.report import results_dir

if TYPE_CHECKING:
    from bench.servers import ServerProcess

logger = logging.getLogger(__name__)

MIB = 2**20
# llama-server's `-c 32768 -np 16`: the tokens of every slot's context together, and the slots.
LLAMA_CONTEXT = 32768
LLAMA_PARALLEL = 16
WARM_UP_MESSAGES = [{"role": "user", "content": "Name three rivers in Europe and say where each one ends."}]
WARM_UP_TOKENS = 32
OTHER_ANONYMOUS = "other anonymous (allocator, interpreter, Python objects)"

# File-backed mappings by library family: the first family whose pattern matches the path (searched
# case-insensitively), else system libraries (.so files under /lib, /usr/lib), other .so files or other
# files.
FILE_FAMILIES: tuple[tuple[str, str], ...] = (
    ("model files (mmap)", r"\.(safetensors|gguf|bin)$"),
    ("oneDNN / MKL / OpenMP", r"/lib(dnnl|mkldnn|mkl_[^/]*|iomp5|gomp[^/]*|omp|openblas[^/]*)\.so"),
    ("torch", r"/site-packages/torch/|/libtorch[^/]*\.so|/libc10[^/]*\.so"),
    ("tandem C++ kernels", r"torch_extensions/|\.torch_ext/|/tandem_cpu[^/]*\.so"),
    ("python", r"/libpython[^/]*\.so|/bin/python[0-9.]*$|/lib-dynload/|/python3\.[0-9]+/[^/]*\.so"),
    ("gRPC", r"/grpc|/grpcio"),
    ("xgrammar", r"xgrammar"),
    ("tokenizers", r"/tokenizers/|tokenizers[^/]*\.so"),
    ("numpy", r"/numpy"),
    ("llama.cpp / ggml", r"/lib(ggml|llama|mtmd)[^/]*\.so|/llama-server$"),
)
SYSTEM_LIBRARIES = "system libraries (libc, libstdc++, libcrypto, ...)"
OTHER_SO = "other .so"
OTHER_FILES = "other files"
ANONYMOUS_PATHS = ("", "[heap]", "[stack]")


@dataclass(frozen=True)
class Mapping:
    """One mapping of /proc/<pid>/smaps: its path (empty for anonymous memory) and its kB counts."""

    path: str
    size_kb: int
    rss_kb: int
    pss_kb: int
    anonymous_kb: int

    @property
    def anonymous(self) -> bool:
        """Memory no file backs: the brk heap, anonymous mmaps (named or not), thread stacks."""
        return self.path in ANONYMOUS_PATHS or self.path.startswith(("[anon", "[stack"))


def parse_smaps(text: str) -> list[Mapping]:
    """The mappings of a /proc/<pid>/smaps text, in order."""
    mappings: list[Mapping] = []
    path: str | None = None
    fields: dict[str, int] = {}

    def close() -> None:
        if path is not None:
            mappings.append(
                Mapping(
                    path,
                    fields.get("Size", 0),
                    fields.get("Rss", 0),
                    fields.get("Pss", 0),
                    fields.get("Anonymous", 0),
                )
            )

    for line in text.splitlines():
        head = line.split(maxsplit=5)
        if head and re.fullmatch(r"[0-9a-f]+-[0-9a-f]+", head[0]):
            close()
            path, fields = (head[5] if len(head) > 5 else ""), {}
        elif len(head) >= 2 and head[0].endswith(":") and head[1].isdigit():
            fields[head[0][:-1]] = int(head[1])
    close()
    return mappings


def family_of(path: str) -> str:
    """The group a file-backed mapping's memory is counted in (see `FILE_FAMILIES`)."""
    path = path.removesuffix(" (deleted)")
    for name, pattern in FILE_FAMILIES:
        if re.search(pattern, path, re.IGNORECASE):
            return name
    if not re.search(r"\.so(\.[0-9.]+)?$", path):
        return OTHER_FILES
    return SYSTEM_LIBRARIES if path.startswith(("/lib", "/usr/lib", "/usr/local/lib")) else OTHER_SO


def account(mappings: Iterable[Mapping], model_parts: dict[str, int] | None = None) -> dict:
    """A process's resident set split into rows that sum to it exactly.

    `model_parts` (name -> bytes, computed) are counted out of its anonymous memory first, each at most
    what is left of it; what remains is `OTHER_ANONYMOUS`. File-backed memory is grouped by
    `family_of`. Returns {"rss_bytes", "pss_bytes", "anonymous_bytes", "rows": [(name, bytes)], "detail"}
    with rows in a fixed order, empty groups left out, and the largest files of each group in detail."""
    mappings = list(mappings)
    anonymous_kb = {"brk heap": 0, "anonymous mmap": 0, "stacks": 0}
    files: dict[str, int] = {}
    per_file: dict[str, dict[str, int]] = {}
    for mapping in mappings:
        if mapping.anonymous:
            kind = (
                "brk heap"
                if mapping.path == "[heap]"
                else "stacks"
                if mapping.path.startswith("[stack")
                else "anonymous mmap"
            )
            anonymous_kb[kind] += mapping.rss_kb
        else:
            family = family_of(mapping.path)
            files[family] = files.get(family, 0) + mapping.rss_kb
            name = mapping.path.removesuffix(" (deleted)").rsplit("/", 1)[-1] or mapping.path
            per_file.setdefault(family, {})
            per_file[family][name] = per_file[family].get(name, 0) + mapping.rss_kb
    anonymous = sum(anonymous_kb.values()) * 1024
    rows: list[tuple[str, int]] = []
    left = anonymous
    for name, size in (model_parts or {}).items():
        counted = min(size, left)
        rows.append((name, counted))
        left -= counted
    rows.append((OTHER_ANONYMOUS, left))
    order = [name for name, _ in FILE_FAMILIES] + [SYSTEM_LIBRARIES, OTHER_SO, OTHER_FILES]
    rows += [(family, files[family] * 1024) for family in order if files.get(family)]
    return {
        "rss_bytes": sum(m.rss_kb for m in mappings) * 1024,
        "pss_bytes": sum(m.pss_kb for m in mappings) * 1024,
        "anonymous_bytes": anonymous,
        "anonymous_split_bytes": {kind: kb * 1024 for kind, kb in anonymous_kb.items()},
        "rows": rows,
        "largest_files_bytes": {
            family: dict(sorted(((f, kb * 1024) for f, kb in names.items()), key=lambda x: -x[1])[:5])
            for family, names in per_file.items()
        },
    }


# ---- the model-sized parts --------------------------------------------------------------------------


def checkpoint_shapes(model_dir: Path) -> dict[str, list[int]]:
    """Every tensor's shape in the checkpoint's safetensors files, from their headers alone."""
    shapes: dict[str, list[int]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(length))
        shapes.update((name, entry["shape"]) for name, entry in header.items() if name != "__metadata__")
    return shapes


def weight_bytes(shapes: dict[str, list[int]], quantization: str, tied: bool, element_bytes: int = 4) -> int:
    """Bytes of the weights as the engine stores them: with int8 quantization (`int8`, `w8a8_int8`) each
    matrix (every tensor of 2 or more dimensions: linears, experts, embedding, LM head) one byte per
    weight plus an fp32 scale per output row (`kernels.int8_linear`, `kernels.int8_embedding`), other
    tensors (norms, biases) `element_bytes` each; unquantized, every tensor `element_bytes` per element.
    A tied LM head reads the embedding's rows: counted once."""
    total = 0
    for name, shape in shapes.items():
        if tied and name == "lm_head.weight":
            continue
        numel = math.prod(shape)
        if quantization != "none" and len(shape) >= 2:
            total += numel + math.prod(shape[:-1]) * 4
        else:
            total += numel * element_bytes
    return total


def model_config(model_dir: Path):
    """The engine's `ModelConfig` of the checkpoint in `model_dir`."""
    from transformers import AutoConfig

    from engine.config import ModelConfig

    return ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))


def kv_block_bytes(model_dir: Path, block_size: int, kv_dtype: str) -> int:
    """Bytes of one KV block (all layers' K and V, scales included) of `kv_dtype` (`torch.float32`,
    `torch.int8`, ... as the engine logs it, or a bare name)."""
    import torch

    from engine.config import CacheConfig

    dtype = getattr(torch, kv_dtype.removeprefix("torch."))
    return CacheConfig(block_size=block_size).block_bytes(model_config(model_dir), dtype)


def engine_ready(log_text: str) -> dict:
    """The fields of the server's (JSON-format) "engine ready" log line, and the engine core's pid from
    "engine core process started (pid N)"."""
    found: dict = {}
    for line in log_text.splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if not isinstance(entry, dict):
                continue
            message = entry.get("message", "")
            if message == "engine ready":
                found.update(entry)
            started = re.match(r"engine core process started \(pid (\d+)\)", message)
            if started:
                found["engine_core_pid"] = int(started.group(1))
    return found


# ---- processes --------------------------------------------------------------------------------------


def children_of(pid: int) -> list[int]:
    """The pids whose parent is `pid` (from /proc/<pid>/stat)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # The name in parentheses may hold spaces: the fields after its last ')' are state, ppid, ...
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(stat.parent.name))
    return sorted(children)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def server_processes(root: int, engine_core_pid: int | None) -> dict[str, int]:
    """Role -> pid of the server `root` and its children (and theirs)."""
    roles = {"front door": root}
    pending = [root]
    while pending:
        for child in children_of(pending.pop()):
            pending.append(child)
            command = _cmdline(child)
            if child == engine_core_pid:
                role = "engine core"
            elif "resource_tracker" in command:
                role = "resource tracker"
            else:
                role = f"child {child}"
            roles[role] = child
    return roles


def read_smaps(pid: int) -> list[Mapping]:
    return parse_smaps(Path(f"/proc/{pid}/smaps").read_text())


def malloc_trim(pid: int) -> bool:
    """Call glibc's malloc_trim(0) in process `pid` through gdb (attached for well under a second);
    False when gdb is missing or could not attach."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return False
    command = [
        gdb, "-p", str(pid), "-batch", "-nx", "-iex", "set auto-solib-add off",
        "-ex", "sharedlibrary libc", "-ex", "call (int) malloc_trim(0)",
    ]  # fmt: skip
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return re.search(r"^\$1 = [01]$", out.stdout, re.MULTILINE) is not None


def measure(roles: dict[str, int], model_parts: dict[str, dict[str, int]], trim: bool) -> dict[str, dict]:
    """Each process's accounting, and with `trim` its accounting again after malloc_trim(0)."""
    result = {
        role: {"pid": pid, "idle": account(read_smaps(pid), model_parts.get(role))}
        for role, pid in roles.items()
    }
    if trim:
        for role, pid in roles.items():
            if malloc_trim(pid):
                result[role]["after_malloc_trim"] = account(read_smaps(pid), model_parts.get(role))
    return result


# ---- the servers ------------------------------------------------------------------------------------


def _post_json(url: str, body: dict, timeout: float = 120.0) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read())


@contextlib.contextmanager
def tandem_server(args: argparse.Namespace, model_dir: Path) -> Iterator[tuple[ServerProcess, dict]]:
    """`tandem serve decode` sized as asked, warmed up and idle; yields it and its server arguments.

    The pool is the flags' default: `--slots` sequences of `--tokens / --slots` tokens each (llama-server's
    per-slot context), which without `--kv-cache-memory` is exactly the tokens they can fill."""
    from bench import servers
    from tandem.client import TandemClient

    server_args = [
        "--quantization", args.quantization,
        "--kv-cache-dtype", args.kv_cache_dtype,
        "--max-model-len", str(args.tokens // args.slots),
        "--block-size", str(args.block_size),
        "--max-num-seqs", str(args.slots),
        "--log-format", "json",
    ]  # fmt: skip
    server, target = servers.tandem_decode_server("tandem-memory", str(model_dir), args.threads, server_args)
    with server:
        with TandemClient(target, timeout=120) as client:
            done = client.complete(messages=WARM_UP_MESSAGES, max_tokens=WARM_UP_TOKENS, temperature=0.0)
        logger.info("warm-up: %d tokens", done.usage.completion_tokens if done.usage else -1)
        time.sleep(args.settle)
        yield server, {"server_args": server_args, "threads": args.threads}


def measure_tandem(args: argparse.Namespace, model_dir: Path) -> dict:
    """The tandem server's accounting, with what was computed for it and how it was started."""
    config = json.loads((model_dir / "config.json").read_text())
    tied = bool(config.get("tie_word_embeddings", False))
    weights = weight_bytes(checkpoint_shapes(model_dir), args.quantization, tied)
    with tandem_server(args, model_dir) as (server, description):
        ready = engine_ready(server.log_path.read_text())
        if "num_blocks" not in ready:
            raise SystemExit(f"no 'engine ready' line with num_blocks in {server.log_path}")
        pool = ready["num_blocks"] * kv_block_bytes(model_dir, ready["block_size"], ready["kv_dtype"])
        parts = {
            "engine core": {
                f"weights ({args.quantization}, computed from the checkpoint)": weights,
                f"KV pool ({ready['num_blocks']} blocks x {ready['block_size']} tokens, "
                f"{ready['kv_dtype'].removeprefix('torch.')})": pool,
            }
        }
        roles = server_processes(server.pid, ready.get("engine_core_pid"))
        if "engine core" not in roles:
            raise SystemExit(f"engine core process not found among {roles} (see {server.log_path})")
        processes = measure(roles, parts, args.malloc_trim)
    return {
        "system": "tandem",
        "label": f"tandem --quantization {args.quantization} --kv-cache-dtype {args.kv_cache_dtype}",
        "server": description,
        "engine_ready": {
            k: ready[k] for k in ("num_blocks", "block_size", "kv_dtype", "quantization") if k in ready
        },
        "kv_pool_tokens": ready["num_blocks"] * ready["block_size"],
        "computed_bytes": {"weights": weights, "kv_pool": pool},
        "processes": processes,
    }


def measure_llama_server(args: argparse.Namespace, model_dir: Path) -> dict | None:
    """llama-server on the Q8_0 GGUF with `-c 32768 -np 16`, after the same warm-up; None if not built.
    Its KV cache (f16 K and V, its default, for every token of the context) is computed from the
    checkpoint's config: its log does not say it at the default verbosity."""
    from bench import servers
    from bench.llama_cpp_build import default_tools

    tools = default_tools()
    if not tools.is_ready():
        logger.warning("llama.cpp not built in %s: llama-server not measured", tools.root)
        return None
    shape = model_config(model_dir)
    kv = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2 * LLAMA_CONTEXT
    server, url = servers.llama_server(
        "llama-server-memory", tools.server, tools.q8_0_model, args.threads, LLAMA_PARALLEL, LLAMA_CONTEXT
    )
    with server:
        _post_json(
            f"{url}/v1/chat/completions",
            {"messages": WARM_UP_MESSAGES, "max_tokens": WARM_UP_TOKENS, "temperature": 0.0},
        )
        time.sleep(args.settle)
        parts = {f"KV cache ({LLAMA_CONTEXT} tokens, f16, computed)": kv}
        processes = measure({"llama-server": server.pid}, {"llama-server": parts}, args.malloc_trim)
    return {
        "system": "llama-server",
        "label": f"llama-server {tools.q8_0_model.name} -c {LLAMA_CONTEXT} -np {LLAMA_PARALLEL}",
        "server": {"parallel": LLAMA_PARALLEL, "context": LLAMA_CONTEXT, "threads": args.threads},
        "computed_bytes": {"kv_cache": kv},
        "processes": processes,
    }


# ---- output -----------------------------------------------------------------------------------------


def total_bytes(run: dict, phase: str = "idle") -> int:
    """The summed RSS of a run's processes in `phase` (`idle`, or `after_malloc_trim` where measured)."""
    return sum(p.get(phase, p["idle"])["rss_bytes"] for p in run["processes"].values())


def table(run: dict) -> str:
    """The breakdown of each process of `run`, idle and after malloc_trim(0), then the total."""
    trimmed = all("after_malloc_trim" in p for p in run["processes"].values())
    lines = [run["label"]]
    for role, process in run["processes"].items():
        idle = process["idle"]
        after = dict(process["after_malloc_trim"]["rows"]) if trimmed else {}
        heading = f"  {role} (pid {process['pid']}), MiB"
        lines.append(f"{heading:<75} {'idle':>10}" + (f" {'trimmed':>10}" if trimmed else ""))
        for name, size in idle["rows"]:
            if size or after.get(name):
                extra = f" {after.get(name, 0) / MIB:>10,.1f}" if trimmed else ""
                lines.append(f"    {name:<70} {size / MIB:>10,.1f}{extra}")
        extra = f" {process['after_malloc_trim']['rss_bytes'] / MIB:>10,.1f}" if trimmed else ""
        lines.append(f"    {'= RSS (MiB)':<70} {idle['rss_bytes'] / MIB:>10,.1f}{extra}")
    extra = (
        f", {total_bytes(run, 'after_malloc_trim') / MIB:,.1f} MiB after malloc_trim(0)" if trimmed else ""
    )
    pss = sum(p["idle"]["pss_bytes"] for p in run["processes"].values())
    lines.append(
        f"  total RSS {total_bytes(run) / MIB:,.1f} MiB{extra} (PSS, shared pages counted once: "
        f"{pss / MIB:,.1f} MiB)"
    )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model dir (default: the cached default model)")
    parser.add_argument("--quantization", default="int8", help="tandem's --quantization (default: int8)")
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="tandem's --kv-cache-dtype (default: auto, the fp32 of the model)",
    )
    parser.add_argument(
        "--tokens", type=int, default=LLAMA_CONTEXT, help=f"KV pool tokens (default: {LLAMA_CONTEXT}, -c)"
    )
    parser.add_argument(
        "--slots", type=int, default=LLAMA_PARALLEL, help=f"--max-num-seqs (default: {LLAMA_PARALLEL}, -np)"
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    parser.add_argument("--threads", type=int, default=2, help="threads of each server (default: 2)")
    parser.add_argument("--settle", type=float, default=5.0, help="idle seconds before reading (default: 5)")
    parser.add_argument(
        "--no-malloc-trim",
        dest="malloc_trim",
        action="store_false",
        help="do not attach gdb to call malloc_trim(0) after the idle reading",
    )
    parser.add_argument(
        "--no-llama-server",
        dest="llama_server",
        action="store_false",
        help="do not measure llama-server (measured by default when llama.cpp is built)",
    )
    parser.add_argument("--out-dir", type=Path, default=results_dir())


def run(args: argparse.Namespace) -> int:
    from bench import session
    from engine.model_store import resolve_model

    model_dir = resolve_model(args.model)
    document = session.header("memory", model=model_dir.name)
    host = document["host"]
    document["runs"] = [measure_tandem(args, model_dir)]
    print(table(document["runs"][0]))
    if args.llama_server:
        peer = measure_llama_server(args, model_dir)
        if peer is not None:
            document["runs"].append(peer)
            print(table(peer))
            ours = document["runs"][0]
            document["ratio_to_llama_server"] = ratio = total_bytes(ours) / total_bytes(peer)
            print(f"tandem / llama-server resident memory: {ratio:.2f}x on {host}")
            if all("after_malloc_trim" in p for run in document["runs"] for p in run["processes"].values()):
                trimmed = total_bytes(ours, "after_malloc_trim") / total_bytes(peer, "after_malloc_trim")
                document["ratio_to_llama_server_after_malloc_trim"] = trimmed
                print(f"after malloc_trim(0) in every process: {trimmed:.2f}x")
    path = session.finish(document, args.out_dir)
    print(f"host: {host}; wrote {path}")
    return 0
