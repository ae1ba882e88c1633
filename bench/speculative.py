"""`tandem bench speculative`: n-gram speculative decoding against plain decoding and llama-server Q8_0.

    tandem bench speculative [--systems ...] [--quick] [--out-dir DIR]

Four labelled held-out chat workloads on the default model, each a few requests built from the Python
standard library (which no model here was tuned on) and rendered with the model's chat template:

- code edit: rename a parameter in, or add type hints to, a standard-library function's source;
- extraction: list what a module docstring names, as JSON, quoting the sentences;
- rewrite: the same docstring, made more polite;
- open chat: open questions whose answers copy nothing.

Each workload runs single-stream (one request at a time, greedy, exact output lengths): decode tok/s as
1 / TPOT p50. Open chat also runs as 16 concurrent streams (output tok/s), where speculation must not
cost throughput. tandem is one `--quantization int8 --speculative ngram` server: each workload runs
first with every request opted out (`disable_speculation`, so plain decoding) and then speculating,
back to back, `--repeats` times, the best of each kept, so the ratio compares one process at one
minute (two fresh servers differed by up to 20% in plain decoding alone). Then llama-server on the
Q8_0 GGUF (`-np 16 -cb -t 2 --no-repack`).

Writes `speculative.json`, `speculative.png` and `README_speculative_table.md` with the host beside
the ratios. About 8 minutes on a quiet 2-core machine; `--quick` runs a smoke-sized version.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import textwrap
from pathlib import Path

from bench import compare
from bench.report import results_dir

logger = logging.getLogger(__name__)

SYSTEMS = ("tandem-int8", "tandem-int8-ngram", "llama-server-q8_0")
LABELS = {
    "tandem-int8": "tandem int8 (requests opted out)",
    "tandem-int8-ngram": "tandem int8 --speculative ngram",
    "llama-server-q8_0": "llama-server Q8_0",
}
COLORS = {"tandem-int8": "tab:blue", "tandem-int8-ngram": "tab:green", "llama-server-q8_0": "tab:gray"}
WORKLOADS = ("code_edit", "extraction", "rewrite", "open_chat")
CONCURRENT = 16

OPEN_QUESTIONS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are three good habits for staying healthy? Explain each briefly.",
    "Why do leaves change colour in autumn?",
    "Plan a relaxed weekend in a small coastal town.",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list (default: {SYSTEMS})")
    parser.add_argument("--threads", type=int, default=2, help="threads of each system (default: 2)")
    parser.add_argument("--quick", action="store_true", help="smoke-sized workloads")
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="tandem runs of each workload per mode, alternating plain and speculating; the best counts "
        "(a neighbour's burst on a shared host slows one run, never speeds one up; default: 2)",
    )
    parser.add_argument("--allow-load", action="store_true", help="run on a busy machine (recorded as such)")
    compare.add_decode_args(parser)
    parser.add_argument("--out-dir", type=Path, default=results_dir())


def chat_texts() -> dict[str, list[str]]:
    """The user turns of each workload, from this interpreter's standard library."""
    import argparse as argparse_module
    import csv
    import heapq
    import json
    import shlex
    import string

    sources = [
        inspect.getsource(f) for f in (textwrap.indent, shlex.quote, heapq.nsmallest, csv.DictReader.__init__)
    ]
    docs = [textwrap.dedent(m.__doc__ or "")[:900] for m in (json, argparse_module, string, csv)]
    code_edit = [
        f"Rename the parameter `{inspect.getfullargspec(f).args[-1]}` to `value` everywhere in this function "
        f"and return the whole function:\n\n```python\n{source}```"
        for f, source in zip((textwrap.indent, shlex.quote), sources[:2], strict=True)
    ] + [
        f"Add type hints to this function and return the whole function:\n\n```python\n{s}```"
        for s in sources[2:]
    ]
    return {
        "code_edit": code_edit,
        "extraction": [
            "Extract every name of a function, class or module this text mentions, as a JSON list of objects "
            f'{{"name": ..., "sentence": ...}} quoting the sentence that names it:\n\n{doc}'
            for doc in docs
        ],
        "rewrite": [
            f"Rewrite this text, keeping it as is except making it more polite:\n\n{doc}" for doc in docs
        ],
        "open_chat": list(OPEN_QUESTIONS),
    }


def workloads_for(args: argparse.Namespace, model_dir: Path) -> dict:
    """Each labelled workload single-stream, and open chat at 16 streams, as token-id requests."""
    from bench.serve import Workload
    from bench.workload import WorkloadRequest, workload_summary
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(model_dir)
    per_workload, output_len = (1, 24) if args.quick else (4, 160)

    def workload(texts: list[str], label: str, repeat: int = 1) -> Workload:
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
        requests = [
            WorkloadRequest(i, tuple(prompts[i % len(prompts)]), output_len)
            for i in range(len(prompts) * repeat)
        ]
        warmups = [WorkloadRequest(0, tuple(prompts[0]), 8)]
        return Workload(requests, warmups, {"source": label, **workload_summary(requests)})

    texts = chat_texts()
    workloads = {
        name: workload(texts[name][:per_workload], f"bench.speculative {name}, single stream")
        for name in WORKLOADS
    }
    streams = CONCURRENT // len(OPEN_QUESTIONS) if not args.quick else 1
    workloads["concurrent"] = workload(
        list(OPEN_QUESTIONS), f"open chat, {CONCURRENT} streams", repeat=streams
    )
    return workloads


SERVER_ARGS = [
    "--quantization",
    "int8",
    "--kv-cache-memory",
    "1GiB",
    "--max-num-seqs",
    "32",
    "--speculative",
    "ngram",
]


def _result(name: str, extra: dict, single: dict[str, dict], concurrent: dict) -> dict:
    result = {
        "system": name,
        "label": LABELS[name],
        "server": extra,
        "single_decode_tok_s": {w: 1000.0 / m["tpot_ms"]["p50"] for w, m in single.items()},
        "concurrent_tok_s": concurrent["output_throughput"],
        "failed": sum(m["failed"] for m in single.values()) + concurrent["failed"],
    }
    logger.info("%s: %s", name, result)
    return result


def _faster(metrics: dict, than: dict, single_stream: bool) -> bool:
    """Whether a repeat beat the best so far: lower TPOT p50 single-stream, more tok/s concurrent."""
    if single_stream:
        return metrics["tpot_ms"]["p50"] < than["tpot_ms"]["p50"]
    return metrics["output_throughput"] > than["output_throughput"]


def measure_tandem(args: argparse.Namespace, model_dir: Path, workloads: dict) -> list[dict]:
    """One `--speculative ngram` server; each workload run with every request opted out
    (`disable_speculation`: plain decoding) and then speculating, back to back, so the ratio compares
    the same process at the same minute."""
    from bench import servers, session
    from bench.backends.tandem_grpc import TandemBackend

    decode, target = servers.tandem_decode_server(
        "tandem-int8-ngram", str(model_dir), args.threads, SERVER_ARGS
    )
    extra = {"threads": args.threads, "server_args": SERVER_ARGS}
    by_mode: dict[str, dict[str, dict]] = {"tandem-int8": {}, "tandem-int8-ngram": {}}
    with decode:
        for workload in (*WORKLOADS, "concurrent"):
            for _ in range(args.repeats):
                for name, results in by_mode.items():
                    backend = TandemBackend(target, name, disable_speculation=name == "tandem-int8")
                    concurrency = None if workload == "concurrent" else 1
                    metrics = session.at_once(backend, workloads[workload], extra, concurrency)
                    if workload not in results or _faster(metrics, results[workload], concurrency == 1):
                        results[workload] = metrics
    return [
        _result(
            name, {**extra, "disable_speculation": name == "tandem-int8"}, single, single.pop("concurrent")
        )
        for name, single in by_mode.items()
    ]


def measure_llama(args: argparse.Namespace, model_dir: Path, workloads: dict) -> dict:
    """Every workload on a fresh llama-server over the Q8_0 GGUF."""
    from bench import quantized, session
    from bench.serve import make_backend

    name = "llama-server-q8_0"
    with quantized.serving(name, args, str(model_dir)) as (kind, target, extra):
        single = {
            w: session.at_once(make_backend(kind, target, name), workloads[w], extra, 1) for w in WORKLOADS
        }
        concurrent = session.at_once(make_backend(kind, target, name), workloads["concurrent"], extra)
    return _result(name, extra, single, concurrent)


def ratios(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Speculation over its own plain decoding, and plain tandem int8 over llama-server Q8_0."""
    by_name = {run["system"]: run for run in runs}
    found = {}
    pairs = (
        ("speculation", "tandem-int8-ngram", "tandem-int8"),
        ("vs_llama", "tandem-int8", "llama-server-q8_0"),
    )
    for key, ours, theirs in pairs:
        if ours in by_name and theirs in by_name:
            a, b = by_name[ours], by_name[theirs]
            found[key] = {w: a["single_decode_tok_s"][w] / b["single_decode_tok_s"][w] for w in WORKLOADS}
            found[key]["concurrent"] = a["concurrent_tok_s"] / b["concurrent_tok_s"]
    return found


def table(document: dict) -> str:
    """The README's rows: single-stream decode tok/s per workload and 16-stream throughput, then ratios."""
    from bench.machine import host_label

    names = {"speculation": "ngram / plain", "vs_llama": "plain / llama-server"}
    lines = [
        "| system | code edit | extraction | rewrite | open chat | open chat, 16 streams |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for run in document["runs"]:
        cells = " | ".join(f"{run['single_decode_tok_s'][w]:.1f}" for w in WORKLOADS)
        lines.append(f"| {run['label']} | {cells} | {run['concurrent_tok_s']:.1f} |")
    for key, ratio in document.get("ratios", {}).items():
        cells = " | ".join(f"**{ratio[w]:.2f}x**" for w in (*WORKLOADS, "concurrent"))
        lines.append(f"| {names[key]} | {cells} |")
    lines.append("")
    lines.append(
        f"Single-stream decode tok/s (1 / TPOT p50) and 16-stream output tok/s, measured "
        f"{document['started'][:10]} on {host_label(document['machine'])}, load average "
        f"{document['load_average_at_start'][0]:.2f} at the start; `tandem bench speculative`."
    )
    return "\n".join(lines) + "\n"


def draw(document: dict, out_dir: Path) -> Path:
    from bench.plots import pyplot, save

    plt = pyplot()
    runs = document["runs"]
    fig, axis = plt.subplots(figsize=(9, 3.5))
    width = 0.8 / max(1, len(runs))
    for i, run in enumerate(runs):
        values = [run["single_decode_tok_s"][w] for w in WORKLOADS]
        axis.bar(
            [x + i * width for x in range(len(WORKLOADS))],
            values,
            width,
            label=run["label"],
            color=COLORS[run["system"]],
        )
    axis.set_xticks([x + width * (len(runs) - 1) / 2 for x in range(len(WORKLOADS))], WORKLOADS)
    axis.set_ylabel("single-stream decode tok/s")
    axis.legend(fontsize=8)
    fig.suptitle(f"Speculative decoding, SmolLM2-135M int8, on {document['machine']['cpu']}", fontsize=10)
    return save(plt, fig, out_dir / "speculative.png")


def run(args: argparse.Namespace) -> int:
    from bench import session
    from bench.servers import ServerStartError
    from engine.model_store import fetch_model

    names = session.systems(args.systems, SYSTEMS)
    start_load, valid = session.quiet_machine(args.allow_load)
    model_dir = fetch_model()
    workloads = workloads_for(args, model_dir)
    document = session.header(
        "speculative",
        start_load,
        threads=args.threads,
        workloads={name: workloads[name].description for name in (*WORKLOADS, "concurrent")},
        runs=[],
        skipped={},
    )
    try:
        if {"tandem-int8", "tandem-int8-ngram"} & set(names):
            document["runs"] += [
                r for r in measure_tandem(args, model_dir, workloads) if r["system"] in names
            ]
        if "llama-server-q8_0" in names:
            document["runs"].append(measure_llama(args, model_dir, workloads))
    except (session.SystemSkipped, ServerStartError) as exc:
        logger.warning("skipping: %s", exc)
        document["skipped"]["run"] = str(exc)
    document["ratios"], document["valid"] = ratios(document["runs"]), valid
    session.finish(document, args.out_dir, table, draw)
    return 0 if not document["skipped"] else 1
