"""`tandem bench perf-report`: issue 17's figures in one run, back to back, each against its target.

    tandem bench perf-report [--sections serving,single,kv,headline] [--quick] [--allow-load]
        [--headline-from-file] [--out-dir DIR]

Sections, in this order (each reuses its own benchmark's machinery):

- serving: `tandem bench serving-path` (near-zero-cost model, 128 streams x 128 tokens, 3 rounds) over
  gRPC and over the OpenAI HTTP API: server CPU µs per token (target ≤ 60) and served tok/s
  (≥ 15,000), the gRPC figures beside the issue's recorded "before" (bench.perf_targets).
- single: tandem aggregated against llama-server (F32 GGUF, one slot), and tandem with int8 weights
  against llama-server on the Q8_0 GGUF, each started the way `tandem bench compare` starts them with 2
  threads, one after the other, sent the same prompts one at a time (256 greedy tokens): TTFT p50 and
  decode tok/s (1 / TPOT p50), each pair's ratio (≥ 1.0x), and the fp32 weight-read bound (weight
  bytes per step / read bandwidth from bench.roofline's probe).
- kv: bench.kv_transfer's servers in this process: KV transfer GB/s by prompt length (≥ 1 GB/s at
  4k tokens) and disaggregated / aggregated TTFT at low load (≤ 1.2 for prompts ≥ 1k tokens); where
  bench.kv_transfer has the wire-only measurement (bench.kv_wire), the wire alone up to 16k tokens.
- headline: `tandem bench compare --systems tandem-aggregated,llama-server --update` on the headline
  workload (the other systems' runs in compare.json are kept; no rate sweep), or with
  `--headline-from-file` the existing compare.json: tandem / llama-server output tok/s (≥ 2x).

Refuses to start when the 1-minute load average is above 1.0 (other processes would void the
comparison) unless `--allow-load`, which runs anyway and records the run as not valid. Writes
`<out-dir>/perf_report.json` and `<out-dir>/perf_report.md`. The full run takes about 12 minutes on
a quiet 2-core machine; `--quick` sizes every section down to a smoke test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from base.errors import TandemError
from bench import perf_targets
from bench.perf_targets import Figure
from bench.report import results_dir

logger = logging.getLogger(__name__)

SECTIONS = ("serving", "single", "kv", "headline")
MAX_START_LOAD = 1.0
THREADS = 2
HEADLINE_SYSTEMS = ("tandem-aggregated", "llama-server")
# Single stream: each tandem precision against llama.cpp at the same weight precision.
SINGLE_PAIRS = (("tandem-aggregated", "llama-server"), ("tandem-aggregated-int8", "llama-server-q8_0"))
# The headline workload's session in compare.json was measured with these SLOs; same again.
HEADLINE_GOODPUT = ["ttft:5000", "tpot:500"]


class SectionError(TandemError):
    """A section's benchmark left no result to report (its own log says why)."""


@dataclass(frozen=True)
class Sizes:
    """How big each section runs: the full report, or a smoke test."""

    serving_streams: int
    serving_output_len: int
    serving_rounds: int
    single_prompts: int
    single_output_len: int
    kv_lengths: tuple[int, ...]
    wire_lengths: tuple[int, ...]
    kv_repeats: int


FULL = Sizes(128, 128, 3, 4, 256, (128, 1024, 4096), (128, 1024, 4096, 16384), 3)
QUICK = Sizes(16, 16, 1, 1, 16, (128,), (128,), 1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the flags of `tandem bench perf-report`."""
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    parser.add_argument("--quick", action="store_true", help="every section sized down (a smoke test)")
    parser.add_argument(
        "--allow-load",
        action="store_true",
        help="run although the machine is busy (the run is marked invalid)",
    )
    parser.add_argument(
        "--serving-apis", default="grpc,http", help="APIs of the serving section (default: grpc,http)"
    )
    parser.add_argument(
        "--headline-from-file",
        action="store_true",
        help="read the headline from the existing compare.json instead of re-measuring it",
    )
    parser.add_argument("--compare-file", type=Path, default=results_dir() / "compare.json")
    parser.add_argument("--model", default=None, help="model dir (default: the cached default model)")
    parser.add_argument("--out-dir", type=Path, default=results_dir())


def _sections(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = set(names) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections: {', '.join(sorted(unknown))} (known: {', '.join(SECTIONS)})")
    return [name for name in SECTIONS if name in names]


def _parse(add: Callable[[argparse.ArgumentParser], None], argv: list[str]) -> argparse.Namespace:
    """Another benchmark's flags, parsed as its own command would: its defaults stay its own."""
    parser = argparse.ArgumentParser()
    add(parser)
    return parser.parse_args(argv)


def serving_section(args: argparse.Namespace, sizes: Sizes, scratch: Path) -> tuple[dict, list[Figure]]:
    """`tandem bench serving-path` per API; the gRPC run against the issue's recorded "before"."""
    from bench import serving_path

    details, figures = {}, []
    before = perf_targets.SERVING_PATH_BEFORE
    for api in [name for name in args.serving_apis.split(",") if name]:
        result_file = scratch / f"serving_path_{api}.json"
        argv = [
            *("--api", api, "--streams", str(sizes.serving_streams)),
            *("--output-len", str(sizes.serving_output_len), "--rounds", str(sizes.serving_rounds)),
            *("--label", f"perf-report-{api}", "--result-file", str(result_file)),
            # The whole vocabulary, as the recorded "before" was measured.
            *("--vocab-size", "0"),
        ]
        if args.quick or api != "grpc":
            argv.append("--no-floor")  # the split is the gRPC run's explanation; once is enough
        code = serving_path.run(_parse(serving_path.add_arguments, argv))
        if not result_file.is_file():
            raise SectionError(f"serving-path over {api} wrote no result (exit {code})")
        result = json.loads(result_file.read_text())
        details[api] = result
        summary = result["summary"]
        cpu = summary["server_cpu_us_per_token"]
        floor = result.get("engine_floor")
        own_figures = []
        if floor:
            step = floor["decode_step_cpu_us_per_token"]
            cpu_note = (
                f"model math {summary['model_math_cpu_us_per_token']:.0f} µs/token (forward "
                f"{step['forward_with_prepare']:.0f}, 49k-wide LM head and sampler "
                f"{step['lm_head_and_sampler']:.0f}), "
                f"engine thread's Python {summary['engine_python_cpu_us_per_token']:.0f}, edge (asyncio, "
                "gRPC messages) "
                f"{summary['edge_cpu_us_per_token']:.0f}"
            )
            own_figures.append(
                Figure(
                    "serving",
                    f"serving path's own CPU per token (server minus model math), {api} "
                    f"{sizes.serving_streams} streams",
                    summary["serving_path_own_cpu_us_per_token"],
                    "µs",
                    perf_targets.SERVER_CPU_PER_TOKEN,
                    None,
                    f"engine thread's Python {summary['engine_python_cpu_us_per_token']:.0f} + edge "
                    f"{summary['edge_cpu_us_per_token']:.0f}{_floors_note(summary)}",
                )
            )
        else:
            cpu_note = (
                "engine-alone split in the gRPC row" if not args.quick else "no engine-alone split (--quick)"
            )
        label = f"{api} {sizes.serving_streams} streams"
        # The figures are of gRPC at 128 streams x 128 tokens: beside that run only.
        comparable = api == "grpc" and sizes == FULL
        figures += [
            Figure(
                "serving",
                f"server CPU per token, {label}",
                cpu,
                "µs",
                perf_targets.SERVER_CPU_PER_TOKEN,
                before["server_cpu_us_per_token"] if comparable else None,
                cpu_note,
            ),
            *own_figures,
            Figure(
                "serving",
                f"served tok/s, {label}",
                summary["served_tok_s"],
                "tok/s",
                perf_targets.SERVED_TOK_S,
                before["served_tok_s"] if comparable else None,
                f"server CPU bound: one busy core gives {1e6 / cpu:,.0f} tok/s at this cost per token; "
                f"server used {_server_cores_busy(result):.2f} cores, the load generator "
                f"{summary['client_cpu_us_per_token']:.0f} µs/token beside it",
            ),
        ]
        if code != 0:
            figures[-1] = replace(figures[-1], note=figures[-1].note + "; some requests failed")
    details["before"] = before
    return details, figures


def _floors_note(summary: dict) -> str:
    """The floors bench.serving_bounds measured in the same run, as a note's tail ("" if none)."""
    floors = []
    if "grpc_write_floor_cpu_us_per_message" in summary:
        floors.append(
            f"a bare grpc.aio server spends {summary['grpc_write_floor_cpu_us_per_message']:.0f} µs "
            "per stream message"
        )
    if "lm_head_floor_cpu_us_per_token" in summary:
        floors.append(
            f"the LM head alone needs {summary['lm_head_floor_cpu_us_per_token']:.0f} µs/token at this "
            "core's fp32 GEMM peak"
        )
    return "; floors in this run: " + ", ".join(floors) if floors else ""


def _server_cores_busy(result: dict) -> float:
    """Median cores the server kept busy over the measured rounds."""
    return statistics.median(r["server_cores_busy"] for r in result["rounds"])


def _compare_args(argv: list[str]) -> argparse.Namespace:
    from bench import compare

    return _parse(compare.add_arguments, ["--threads", str(THREADS), "--no-progress", *argv])


def weight_read_bound(model_dir: Path) -> dict:
    """Batch-1 decode reads every weight once per token: its tok/s can be no more than bandwidth / bytes."""
    from bench.roofline import ModelShape, probe_machine

    shape = ModelShape.from_config_file(model_dir / "config.json")
    probe = probe_machine(THREADS)
    return {
        "weight_bytes_per_step": shape.weight_bytes,
        "read_bandwidth_gbs": probe.read_bandwidth_gbs,
        "tok_s": round(probe.read_bandwidth_gbs * 1e9 / shape.weight_bytes, 1),
    }


def single_section(args: argparse.Namespace, sizes: Sizes) -> tuple[dict, list[Figure]]:
    """Each tandem precision and llama-server at the same precision, one request at a time, same prompts."""
    from bench.compare import serving
    from bench.roofline import ModelShape
    from bench.serve import build_workload, make_backend, measure
    from bench.workload import ArrivalProcess
    from engine.model_store import resolve_model

    model_dir = resolve_model(args.model)
    compare_args = _compare_args(
        [
            *("--num-prompts", str(sizes.single_prompts), "--output-len", f"fixed:{sizes.single_output_len}"),
            *(
                "--num-warmups",
                "1",
                "--max-num-seqs",
                "4",
                "--llama-parallel",
                "1",
                "--llama-context",
                "4096",
            ),
        ]
    )
    workload = build_workload(compare_args, ModelShape.from_config_file(model_dir / "config.json").vocab)
    runs = {}
    for name in (name for pair in SINGLE_PAIRS for name in pair):
        with serving(name, compare_args, str(model_dir)) as (kind, target, extra):
            backend = make_backend(kind, target, name)
            runs[name] = asyncio.run(
                measure(
                    backend, compare_args, ArrivalProcess(math.inf), False, extra, workload, max_concurrency=1
                )
            )
    bound = weight_read_bound(model_dir)
    rates = {name: 1000.0 / run["metrics"]["tpot_ms"]["p50"] for name, run in runs.items()}
    fractions = {name: rate / bound["tok_s"] for name, rate in rates.items()}
    bound_note = (
        f"fp32 weight-read bound {bound['tok_s']:.0f} tok/s ({bound['weight_bytes_per_step'] / 1e6:.0f} MB "
        f"per step at {bound['read_bandwidth_gbs']:.1f} GB/s)"
    )
    figures = []
    for name, run in runs.items():
        metrics = run["metrics"]
        failed = f"; {metrics['failed']} requests failed" if metrics["failed"] else ""
        figures += [
            Figure("single", f"TTFT p50, {name}", metrics["ttft_ms"]["p50"], "ms", note=failed.lstrip("; ")),
            Figure(
                "single",
                f"decode tok/s (1/TPOT p50), {name}",
                round(rates[name], 1),
                "tok/s",
                note=f"{fractions[name]:.0%} of the fp32 weight-read bound",
            ),
        ]
    for tandem, llama in SINGLE_PAIRS:
        figures.append(
            Figure(
                "single",
                f"decode tok/s, {tandem} / {llama}",
                round(rates[tandem] / rates[llama], 3),
                "x",
                perf_targets.SINGLE_STREAM_RATIO,
                note=bound_note,
            )
        )
    return {"workload": workload.description, "weight_read_bound": bound, "runs": runs}, figures


def kv_section(args: argparse.Namespace, sizes: Sizes) -> tuple[dict, list[Figure]]:
    """bench.kv_transfer's transfer and TTFT measurements, with its servers in this process."""
    import torch

    from bench import kv_transfer
    from engine.model_store import resolve_model

    torch.set_num_threads(THREADS)
    model_dir = resolve_model(args.model)
    result = {"serve": kv_transfer.measure(model_dir, list(sizes.kv_lengths), sizes.kv_repeats)}
    figures = []
    if hasattr(kv_transfer, "measure_wire_section"):
        result["wire"], figures = _kv_wire(kv_transfer, model_dir, sizes)
    for row in result["serve"]["results"]:
        tokens = row["prompt_tokens"]
        gbps = row["transfer_MBps"] / 1000
        note = (
            f"{row['kv_payload_bytes'] / 1e6:.1f} MB in {row['kv_messages']} messages, "
            f"{row['transfer_seconds_median'] * 1e3:.0f} ms ({row['transfer_us_per_token']:.0f} µs/token)"
        )
        figures.append(
            Figure(
                "kv",
                f"KV transfer between servers, {tokens}-token prompt",
                round(gbps, 3),
                "GB/s",
                perf_targets.KV_GBPS_AT_4K if tokens == 4096 else None,
                note=note,
            )
        )
        figures.append(
            Figure(
                "kv",
                f"TTFT disaggregated / aggregated, {tokens}-token prompt",
                round(row["ttft_ratio_disaggregated_over_aggregated"], 3),
                "x",
                perf_targets.DISAGG_TTFT_RATIO if tokens >= 1024 else None,
                note=f"aggregated {row['ttft_aggregated_seconds_median'] * 1e3:.0f} ms, disaggregated "
                f"{row['ttft_disaggregated_seconds_median'] * 1e3:.0f} ms (low load: one request at a time)",
            )
        )
    return result, figures


def _kv_wire(kv_transfer, model_dir: Path, sizes: Sizes) -> tuple[dict, list[Figure]]:
    """The KV wire alone (bench.kv_wire: real sender and codec, no model) at the product's message size,
    where bench.kv_transfer has it: cheap enough to reach 16k-token prompts."""
    from kv_transfer.wire import MAX_MESSAGE_BYTES

    layout = kv_transfer.model_layout(model_dir)
    wire = kv_transfer.measure_wire_section(
        layout, list(sizes.wire_lengths), [MAX_MESSAGE_BYTES], sizes.kv_repeats
    )
    figures = [
        Figure(
            "kv",
            f"KV wire alone, {row['prompt_tokens']}-token prompt",
            round(row["GBps"], 3),
            "GB/s",
            perf_targets.KV_GBPS_AT_4K if row["prompt_tokens"] == 4096 else None,
            note=f"{row['messages']} messages of ≤ {MAX_MESSAGE_BYTES >> 10} KiB; CPU sender "
            f"{row['sender_cpu_seconds_median'] * 1e3:.0f} ms, receiver "
            f"{row['receiver_cpu_seconds_median'] * 1e3:.0f} ms: {row['cpu_bound_GBps']:.2f} GB/s with a "
            f"core per side; CRC32C {wire['crc32c_GBps_one_pass']:.1f} GB/s per pass",
        )
        for row in wire["results"]
    ]
    return wire, figures


def headline_section(args: argparse.Namespace, scratch: Path) -> tuple[dict, list[Figure]]:
    """`tandem bench compare` for tandem-aggregated and llama-server (or its existing file)."""
    from bench import compare

    path = args.compare_file
    if not args.headline_from_file:
        argv = [
            "--systems",
            ",".join(HEADLINE_SYSTEMS),
            "--rates",
            "",
            "--no-plots",
            "--goodput",
            *HEADLINE_GOODPUT,
        ]
        if args.quick:
            # A smoke test must not replace the headline: its own small workload, its own file.
            argv += ["--num-prompts", "4", "--prompt-len", "fixed:32", "--output-len", "fixed:16"]
            argv += ["--num-warmups", "1", "--out-dir", str(scratch)]
            path = scratch / "compare.json"
        else:
            argv += ["--update", "--out-dir", str(path.parent)]
        compare.run(_compare_args(argv))
    document = json.loads(path.read_text())
    runs = {run["system"]["name"]: run for run in document["runs"]}
    missing = [name for name in HEADLINE_SYSTEMS if name not in runs]
    if missing:
        raise SectionError(f"{path} has no run of {', '.join(missing)}: {document.get('skipped', {})}")
    throughput = {name: runs[name]["metrics"]["output_throughput"] for name in HEADLINE_SYSTEMS}
    tandem, llama = HEADLINE_SYSTEMS
    limit = document.get("physical_limit") or {}
    bound = limit.get("output_tok_s_bound")
    note = (
        f"physical limit {bound:.0f} tok/s ({limit['limited_by']}-bound, bench.roofline); tandem "
        f"{throughput[tandem] / bound:.0%} of it, llama-server {throughput[llama] / bound:.0%}"
        if bound
        else "no physical limit in the compare file"
    )
    figures = [
        Figure("headline", f"output tok/s, {name}", round(throughput[name], 1), "tok/s")
        for name in HEADLINE_SYSTEMS
    ]
    figures.append(
        Figure(
            "headline",
            "output tok/s, tandem / llama-server F32",
            round(throughput[tandem] / throughput[llama], 3),
            "x",
            perf_targets.HEADLINE_RATIO,
            note=note,
        )
    )
    details = {
        "compare_file": str(path),
        "remeasured": not args.headline_from_file,
        "workload": document["workload"],
        "physical_limit": limit or None,
        "runs": {name: runs[name]["metrics"] for name in HEADLINE_SYSTEMS},
        "load_average_at_write": document.get("load_average_at_write"),
    }
    return details, figures


def run(args: argparse.Namespace) -> int:
    """Entry of `tandem bench perf-report`: check the load, run the sections, write JSON and markdown."""
    from bench.machine import load_average, machine_info
    from bench.report import command_line, write_json

    sections = _sections(args.sections)
    sizes = QUICK if args.quick else FULL
    load_before = load_average()
    invalid_reason = None
    if load_before[0] > MAX_START_LOAD:
        invalid_reason = f"1-minute load average {load_before[0]} at start is above {MAX_START_LOAD}"
        if not args.allow_load:
            logger.error(
                "%s: other processes would void the comparison (--allow-load runs anyway)", invalid_reason
            )
            return 2
        logger.warning("%s; running anyway (--allow-load), the run is recorded as not valid", invalid_reason)
    if args.quick:
        invalid_reason = "; ".join(filter(None, [invalid_reason, "--quick: sections sized down"]))
    machine = machine_info()
    started = time.monotonic()
    details: dict = {}
    figures: list[Figure] = []
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="tandem-perf-report-") as scratch:
        runners = {
            "serving": lambda: serving_section(args, sizes, Path(scratch)),
            "single": lambda: single_section(args, sizes),
            "kv": lambda: kv_section(args, sizes),
            "headline": lambda: headline_section(args, Path(scratch)),
        }
        for name in sections:
            section_started = time.monotonic()
            logger.info("perf-report section %s: starting", name)
            try:
                details[name], section_figures = runners[name]()
            except Exception as exc:  # one section that fails must not lose the others' figures
                logger.exception("perf-report section %s failed", name)
                skipped[name] = f"{type(exc).__name__}: {exc}"
                continue
            figures += section_figures
            details[name]["duration_s"] = round(time.monotonic() - section_started, 1)
            logger.info("perf-report section %s: done in %.0f s", name, details[name]["duration_s"])
    report = {
        "schema_version": perf_targets.SCHEMA_VERSION,
        "benchmark": "perf_report",
        "command": command_line(),
        "machine": machine,
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "valid": invalid_reason is None and not skipped,
        "invalid_reason": invalid_reason
        if not skipped
        else "; ".join(filter(None, [invalid_reason, "sections failed"])),
        "quick": args.quick,
        "sections_run": sections,
        "duration_s": round(time.monotonic() - started, 1),
        "figures": perf_targets.figure_rows(figures),
        "sections": details,
        "skipped": skipped,
    }
    json_path = write_json(args.out_dir / "perf_report.json", report)
    markdown = perf_targets.render_markdown(report)
    markdown_path = args.out_dir / "perf_report.md"
    markdown_path.write_text(markdown)
    print(markdown)
    logger.info("wrote %s and %s", json_path, markdown_path)
    return 1 if skipped else 0
