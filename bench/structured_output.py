"""`tandem bench structured-output`: what a JSON-schema constraint costs a stream, and whether
jump-forward would pay.

    tandem bench structured-output [--streams 32 --max-tokens 128 --phase-seconds 30 --rounds 2] [--quick]

Starts one `tandem serve decode` (the cached SmolLM2-135M-Instruct by default; `--quick` a near-zero
random model with the same tokenizer, for smoke tests) with its metrics port, and drives it over gRPC
with `--streams` closed-loop workers: each sends requests one after another for `--phase-seconds`, so
the batch stays full whether an answer ends early or not. Every request is a chat prompt from
bench.structured_corpus, greedy, `--max-tokens` at most; a phase sends them all unconstrained or all
with the prompt's JSON schema (`GenerateRequest.structured_output.json_schema`). Phases alternate
(unconstrained, constrained) for `--rounds` rounds in the same server, then one mixed phase (half of the
workers constrained) shows what constrained neighbours cost unconstrained streams.

Per-token inter-token latency is the gap between consecutive stream messages divided by the tokens the
later one carries, taken only while every worker has a request in flight (from the last worker's first
token to the end of the phase's sending time), so the batch size is the same in both kinds of phase.
ignore_eos is impossible with a grammar (the grammar ends the answer), so the comparison is per token
produced, not per request. The ratio constrained / unconstrained at p50 and p90 is the figure of merit
(target <= 1.15).

From the server's /metrics, per phase: `tandem:structured_output_fill_seconds` (mask fill time per step
that masked a row) and `tandem:structured_output_compile_seconds` (compiles: the first constrained round
compiles each schema once, later rounds hit the cache). In this process: each schema's compile as the
engine core runs it (`decode_service.engine_core.grammar_compiler`'s worker), and the
jump-forward potential: each constrained answer is replayed through an xgrammar matcher, and a token
counts as forced when it lies
wholly inside the text `find_jump_forward_string()` returns before it, i.e. a jump-forward decoder could
have appended it without a forward pass of its own. Writes `structured_output.json` and
`structured_output.png`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shlex
import statistics
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.report import results_dir
from bench.structured_corpus import CORPUS, SYSTEM_PROMPT, SchemaCase

logger = logging.getLogger(__name__)

ITL_RATIO_TARGET = 1.15
FILL_METRIC = "tandem:structured_output_fill_seconds"
COMPILE_METRIC = "tandem:structured_output_compile_seconds"
REQUEST_TIMEOUT_S = 600.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the flags of `tandem bench structured-output`."""
    parser.add_argument("--model", default=None, help="model dir (default: the cached default model)")
    parser.add_argument(
        "--streams", type=int, default=32, help="concurrent closed-loop streams (default: 32)"
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="max tokens per request (default: 128)")
    parser.add_argument(
        "--phase-seconds", type=float, default=30.0, help="each stream sends requests this long (default: 30)"
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="(unconstrained, constrained) phase pairs (default: 2)"
    )
    parser.add_argument("--no-mixed", action="store_true", help="skip the half-constrained phase")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0)")
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads (default: 1)")
    parser.add_argument(
        "--server-args", default="", help="more `tandem serve decode` flags, one shell-quoted string"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: a near-zero random model with the real tokenizer, 4 streams, 24 tokens, 1 round",
    )
    parser.add_argument("--result-file", type=Path, default=results_dir() / "structured_output.json")


@dataclass
class Plan:
    """One request to send: which corpus case, with or without its schema."""

    case: SchemaCase
    constrained: bool


@dataclass
class Record:
    """What the client saw of one request (times on the perf_counter clock)."""

    case: str
    constrained: bool
    send_time: float
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None

    def token_gaps(self, start: float, end: float) -> list[float]:
        """Seconds per token between consecutive messages inside [start, end], one value per token."""
        gaps: list[float] = []
        for i in range(1, len(self.chunk_times)):
            earlier, later = self.chunk_times[i - 1], self.chunk_times[i]
            if start <= earlier and later <= end:
                gaps += [(later - earlier) / self.chunk_tokens[i]] * self.chunk_tokens[i]
        return gaps


def _request(plan: Plan, max_tokens: int, temperature: float, request_id: str):
    from protos.tandem.v1 import generation_pb2 as pb

    request = pb.GenerateRequest(
        request_id=request_id,
        messages=[
            pb.ChatMessage(role="system", content=SYSTEM_PROMPT),
            pb.ChatMessage(role="user", content=plan.case.prompt),
        ],
        sampling=pb.SamplingParams(temperature=temperature),
        stopping=pb.StoppingParams(max_tokens=max_tokens),
    )
    if plan.constrained:
        request.structured_output.json_schema = json.dumps(plan.case.schema)
    return request


async def _send(stub, plan: Plan, max_tokens: int, temperature: float, request_id: str) -> Record:
    import grpc

    from protos.tandem.v1 import generation_pb2 as pb

    record = Record(plan.case.name, plan.constrained, time.perf_counter())
    try:
        call = stub.Generate(_request(plan, max_tokens, temperature, request_id), timeout=REQUEST_TIMEOUT_S)
        async for message in call:
            if message.token_ids:
                record.chunk_times.append(time.perf_counter())
                record.chunk_tokens.append(len(message.token_ids))
                record.token_ids.extend(message.token_ids)
            record.text += message.text
            if message.finish_reason:
                record.finish_reason = pb.FinishReason.Name(message.finish_reason)
    except grpc.aio.AioRpcError as exc:
        record.error = f"{exc.code().name}: {exc.details()}"
    return record


async def run_phase(
    stub, label: str, workers: list[list[Plan]], args: argparse.Namespace, seconds: float
) -> dict[str, Any]:
    """Every worker cycles through its plans back to back until `seconds` have passed (the request in
    flight then finishes); the window with every worker busy runs from the last first token to then."""
    records: list[Record] = []
    first_tokens: list[float] = []
    started = time.perf_counter()
    deadline = started + seconds

    async def worker(index: int, plans: list[Plan]) -> None:
        number = 0
        while number == 0 or time.perf_counter() < deadline:
            plan = plans[number % len(plans)]
            record = await _send(stub, plan, args.max_tokens, args.temperature, f"{label}-w{index}-r{number}")
            records.append(record)
            if number == 0 and record.chunk_times:
                first_tokens.append(record.chunk_times[0])
            if record.error is not None:  # recorded; retrying at once would only spin on a refusal
                return
            number += 1

    await asyncio.gather(*(worker(i, plans) for i, plans in enumerate(workers)))
    duration = time.perf_counter() - started
    window = (max(first_tokens, default=started), deadline)
    if window[0] >= window[1]:  # no moment with every worker busy (a tiny smoke run): take every gap
        window = (started, started + duration)
    return {"label": label, "records": records, "window": window, "duration_s": duration}


def _quantiles_ms(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(1000.0 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {
        "n": len(values),
        "mean": round(1000.0 * statistics.fmean(values), 3),
        "p50": at(0.5),
        "p90": at(0.9),
        "p99": at(0.99),
    }


def summarize_phase(phase: dict[str, Any], constrained: bool | None = None) -> dict[str, Any]:
    """ITL quantiles (ms, per token, full-batch window) and outcomes of one phase's records; `constrained`
    picks one kind of request in a mixed phase."""
    records = [r for r in phase["records"] if constrained is None or r.constrained == constrained]
    start, end = phase["window"]
    gaps = [gap for record in records for gap in record.token_gaps(start, end)]
    finished = [r for r in records if r.error is None]
    ttfts = [r.chunk_times[0] - r.send_time for r in finished if r.chunk_times]
    reasons: dict[str, int] = {}
    for record in finished:
        reasons[record.finish_reason or "none"] = reasons.get(record.finish_reason or "none", 0) + 1
    return {
        "requests": len(records),
        "errors": len(records) - len(finished),
        "first_error": next((r.error for r in records if r.error), None),
        "tokens": sum(len(r.token_ids) for r in records),
        "finish_reasons": reasons,
        "itl_ms": _quantiles_ms(gaps),
        "ttft_ms": _quantiles_ms(ttfts),
    }


def schema_validity(records: list[Record]) -> dict[str, int]:
    """How many constrained answers that the grammar ended (STOP) parse and satisfy their schema."""
    import jsonschema

    schemas = {case.name: case.schema for case in CORPUS}
    checked = valid = 0
    for record in records:
        if not record.constrained or record.error or record.finish_reason != "STOP":
            continue
        checked += 1
        try:
            jsonschema.validate(json.loads(record.text), schemas[record.case])
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError):
            logger.warning("a %s answer does not satisfy its schema: %r", record.case, record.text[:200])
    return {"checked": checked, "valid": valid}


def scrape(url: str) -> dict[str, float]:
    """Every sample of the server's /metrics by name (histograms' `_count`/`_sum` unlabelled)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }


def histogram_delta(before: dict[str, float], after: dict[str, float], name: str) -> dict[str, Any]:
    """Observations of histogram `name` between two scrapes; None fields where the server lacks it."""
    if f"{name}_count" not in after:
        return {"count": None, "sum_s": None, "mean_ms": None}
    count = after[f"{name}_count"] - before.get(f"{name}_count", 0.0)
    total = after[f"{name}_sum"] - before.get(f"{name}_sum", 0.0)
    return {
        "count": int(count),
        "sum_s": round(total, 6),
        "mean_ms": round(1000.0 * total / count, 4) if count else None,
    }


def _workers(constrained: list[bool]) -> list[list[Plan]]:
    """Worker i cycles through the corpus from case i, constrained as `constrained[i]`."""
    return [
        [Plan(CORPUS[(i + k) % len(CORPUS)], bound) for k in range(len(CORPUS))]
        for i, bound in enumerate(constrained)
    ]


async def drive(args: argparse.Namespace, target: str, metrics_url: str) -> list[dict[str, Any]]:
    """Warm-up, then the alternating phases and the mixed one; each with its /metrics deltas."""
    import grpc

    from protos.tandem.v1 import generation_pb2_grpc

    schedule: list[tuple[str, list[bool]]] = []
    for number in range(1, args.rounds + 1):
        schedule.append((f"unconstrained-{number}", [False] * args.streams))
        schedule.append((f"constrained-{number}", [True] * args.streams))
    if not args.no_mixed:
        schedule.append(("mixed", [i % 2 == 1 for i in range(args.streams)]))
    phases = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await run_phase(stub, "warmup", _workers([False] * args.streams), args, 0.0)
        for label, constrained in schedule:
            before = scrape(metrics_url)
            phase = await run_phase(stub, label, _workers(constrained), args, args.phase_seconds)
            after = scrape(metrics_url)
            phase["fill"] = histogram_delta(before, after, FILL_METRIC)
            phase["compile"] = histogram_delta(before, after, COMPILE_METRIC)
            phases.append(phase)
            logger.info("%s: %s", label, json.dumps(summarize_phase(phase)["itl_ms"]))
    return phases


def measure_compile(model_dir: Path) -> dict[str, Any]:
    """Each corpus schema compiled as the engine core compiles it (its worker process compiles, sends
    xgrammar's JSON, the core rebuilds the grammar), after a warm-up compile that starts the worker; and
    bare xgrammar in this process for reference. A repeated schema is the core's cache's: no compile."""
    import xgrammar as xgr

    from decode_service.engine_core.grammar_compiler import GrammarCompiler, compile_in_process

    tokenizer, vocab_size, stop_ids = _tokenizer(model_dir)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
    compiler = GrammarCompiler(info, timeout_s=60.0)
    per_schema = {}
    try:
        started = time.perf_counter()
        compiler.compile("regex", "(warm|up)", "warmup")
        worker_start_s = time.perf_counter() - started
        bare = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        for case in CORPUS:
            spec = json.dumps(case.schema)
            started = time.perf_counter()
            compiler.compile("json_schema", spec, "structured_output.json_schema")
            cold_ms = 1000.0 * (time.perf_counter() - started)
            started = time.perf_counter()
            compile_in_process(bare, "json_schema", spec)
            per_schema[case.name] = {
                "cold_ms": round(cold_ms, 3),
                "xgrammar_in_process_ms": round(1000.0 * (time.perf_counter() - started), 3),
            }
    finally:
        compiler.close()
    cold = [row["cold_ms"] for row in per_schema.values()]
    return {
        "worker_start_and_first_compile_s": round(worker_start_s, 3),
        "cold_ms_median": round(statistics.median(cold), 3),
        "cold_ms_max": round(max(cold), 3),
        "xgrammar_in_process_ms_median": round(
            statistics.median(r["xgrammar_in_process_ms"] for r in per_schema.values()), 3
        ),
        "per_schema": per_schema,
    }


def _tokenizer(model_dir: Path):
    """The HF tokenizer, vocabulary size and stop ids the server's grammars are compiled against."""
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    eos = config.get("eos_token_id")
    stop_ids = set(tokenizer.eos_token_ids) | set(eos if isinstance(eos, list) else [eos] if eos else [])
    return tokenizer.hf, config["vocab_size"], sorted(stop_ids)


def forced_tokens(matcher, token_ids: list[int], vocab: list[bytes]) -> dict[str, float]:
    """Replay one constrained answer through `matcher`, asking before each token what text the grammar
    forces: `forced` counts tokens lying wholly inside it (a jump-forward decoder appends those without a
    decode step of their own), `steps_forced` tokens preceded by any forced text, `ask_us` the cost of
    asking. `replayed` is False where the grammar refused a token (the answer was not from this grammar)."""
    row = {"tokens": 0, "forced": 0, "steps_forced": 0, "forced_chars": 0, "ask_us": 0.0, "replayed": True}
    for token in token_ids:
        started = time.perf_counter()
        text = matcher.find_jump_forward_string().encode()
        row["ask_us"] += 1e6 * (time.perf_counter() - started)
        if text:
            row["steps_forced"] += 1
            row["forced_chars"] += len(text)
            row["forced"] += bool(vocab[token]) and text.startswith(vocab[token])
        if not matcher.accept_token(token):
            row["replayed"] = False
            break
        row["tokens"] += 1
    return row


def jump_forward_potential(model_dir: Path, records: list[Record]) -> dict[str, Any]:
    """Over every constrained answer: the share of tokens the grammar forced, overall and per schema."""
    import xgrammar as xgr

    from decode_service.engine_core.grammar_compiler import compile_in_process

    tokenizer, vocab_size, stop_ids = _tokenizer(model_dir)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    grammars = {
        case.name: compile_in_process(compiler, "json_schema", json.dumps(case.schema)) for case in CORPUS
    }
    vocab = [bytes(piece) for piece in info.decoded_vocab]
    totals: dict[str, dict[str, float]] = {}
    for record in records:
        if not record.constrained or record.error or not record.token_ids:
            continue
        replay = forced_tokens(xgr.GrammarMatcher(grammars[record.case]), record.token_ids, vocab)
        row = totals.setdefault(record.case, {"answers": 0, "not_replayed": 0})
        row["answers"] += 1
        row["not_replayed"] += 0 if replay.pop("replayed") else 1
        for key, value in replay.items():
            row[key] = row.get(key, 0) + value

    def shares(row: dict[str, float]) -> dict[str, Any]:
        return {
            "answers": int(row["answers"]),
            "not_replayed": int(row["not_replayed"]),
            "tokens": int(row.get("tokens", 0)),
            "forced_token_fraction": round(row.get("forced", 0) / max(row.get("tokens", 0), 1), 4),
            "tokens_after_forced_text_fraction": round(
                row.get("steps_forced", 0) / max(row.get("tokens", 0), 1), 4
            ),
            "mean_forced_chars": round(row.get("forced_chars", 0) / max(row.get("steps_forced", 0), 1), 2),
            "ask_us_per_token": round(row.get("ask_us", 0) / max(row.get("tokens", 0), 1), 2),
        }

    overall: dict[str, float] = {}
    for row in totals.values():
        for key, value in row.items():
            overall[key] = overall.get(key, 0) + value
    return {
        **shares(overall or {"answers": 0, "not_replayed": 0}),
        "per_schema": {k: shares(v) for k, v in totals.items()},
    }


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return round(numerator / denominator, 3) if numerator and denominator else None


def summarize(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """ITL by kind over all rounds, the ratios against the target, fill time per step, compiles."""
    free = [p for p in phases if p["label"].startswith("unconstrained")]
    bound = [p for p in phases if p["label"].startswith("constrained")]
    free_itl, bound_itl = (
        _quantiles_ms([gap for p in group for r in p["records"] for gap in r.token_gaps(*p["window"])])
        for group in (free, bound)
    )
    fill_counts = sum(p["fill"]["count"] or 0 for p in bound)
    fill_sum = sum(p["fill"]["sum_s"] or 0.0 for p in bound)
    summary: dict[str, Any] = {
        "itl_ms_unconstrained": free_itl,
        "itl_ms_constrained": bound_itl,
        "itl_ratio_p50": _ratio(bound_itl["p50"], free_itl["p50"]),
        "itl_ratio_p90": _ratio(bound_itl["p90"], free_itl["p90"]),
        "itl_ratio_target": ITL_RATIO_TARGET,
        "fill_steps_observed": fill_counts if bound and bound[0]["fill"]["count"] is not None else None,
        "fill_ms_per_masked_step": round(1000.0 * fill_sum / fill_counts, 4) if fill_counts else None,
        "server_compiles_by_constrained_phase": [p["compile"]["count"] for p in bound],
        "constrained_ttft_ms_p50_by_phase": [summarize_phase(p)["ttft_ms"]["p50"] for p in bound],
    }
    if summary["itl_ratio_p50"] is not None and summary["itl_ratio_p90"] is not None:
        summary["meets_target"] = max(summary["itl_ratio_p50"], summary["itl_ratio_p90"]) <= ITL_RATIO_TARGET
    if summary["fill_ms_per_masked_step"] and bound_itl["p50"]:
        summary["fill_share_of_constrained_step"] = round(
            summary["fill_ms_per_masked_step"] / bound_itl["p50"], 4
        )
    mixed = next((p for p in phases if p["label"] == "mixed"), None)
    if mixed is not None:
        summary["mixed_itl_ms_constrained"] = summarize_phase(mixed, constrained=True)["itl_ms"]
        summary["mixed_itl_ms_unconstrained"] = summarize_phase(mixed, constrained=False)["itl_ms"]
    return summary


def _server_flags(args: argparse.Namespace, metrics_port: int) -> list[str]:
    streams = str(args.streams)
    return [
        "--max-num-seqs",
        streams,
        "--max-queue",
        streams,
        "--max-validation-queue",
        streams,
        "--max-num-batched-tokens",
        str(max(512, args.streams)),
        "--metrics-port",
        str(metrics_port),
        *shlex.split(args.server_args),
    ]


def _apply_quick(args: argparse.Namespace) -> None:
    args.streams = min(args.streams, 4)
    args.max_tokens = min(args.max_tokens, 24)
    args.phase_seconds = min(args.phase_seconds, 2.0)
    args.rounds = 1
    args.threads = 1


def run(args: argparse.Namespace) -> int:
    """Entry of `tandem bench structured-output`: server, phases, compile and jump-forward, JSON, plot."""
    from bench.machine import load_average, machine_info
    from bench.metrics import cdf_points
    from bench.near_zero_model import NearZeroModelSpec, write_near_zero_model
    from bench.plots import draw_structured_output
    from bench.report import command_line, write_json
    from bench.servers import free_port, running, tandem_decode_server
    from engine.model_store import resolve_model

    if args.quick:
        _apply_quick(args)
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="tandem-structured-") as scratch:
        model_dir = resolve_model(args.model)
        model_name = model_dir.name
        if args.quick:
            model_dir = write_near_zero_model(Path(scratch) / "model", model_dir, NearZeroModelSpec())
            model_name = f"near-zero model with the {model_name} tokenizer"
        metrics_port = free_port()
        flags = _server_flags(args, metrics_port)
        server, target = tandem_decode_server("structured-output-decode", str(model_dir), args.threads, flags)
        with running(server):
            phases = asyncio.run(drive(args, target, f"http://127.0.0.1:{metrics_port}/metrics"))
        records = [record for phase in phases for record in phase["records"]]
        compile_times = measure_compile(model_dir)
        jump_forward = jump_forward_potential(model_dir, records)
    summary = summarize(phases)
    summary["compile_ms_cold_median"] = compile_times["cold_ms_median"]
    summary["jump_forward_forced_token_fraction"] = jump_forward["forced_token_fraction"]
    validity = schema_validity(records)
    result = {
        "benchmark": "structured_output",
        "machine": machine,
        "command": command_line(),
        "model": model_name,
        "workload": {
            "streams": args.streams,
            "max_tokens": args.max_tokens,
            "phase_seconds": args.phase_seconds,
            "rounds": args.rounds,
            "temperature": args.temperature,
            "schemas": [case.name for case in CORPUS],
            "api": "grpc",
        },
        "server": {"threads": args.threads, "args": flags},
        "summary": summary,
        "phases": [
            {
                "label": p["label"],
                "duration_s": round(p["duration_s"], 3),
                "full_batch_window_s": round(p["window"][1] - p["window"][0], 3),
                **summarize_phase(p),
                "fill": p["fill"],
                "compile": p["compile"],
            }
            for p in phases
        ],
        "itl_ms_cdf": {
            kind: cdf_points(
                [
                    gap
                    for p in phases
                    if p["label"].startswith(kind)
                    for r in p["records"]
                    for gap in r.token_gaps(*p["window"])
                ]
            )
            for kind in ("unconstrained", "constrained")
        },
        "schema_validity": validity,
        "compile": compile_times,
        "jump_forward": jump_forward,
        "quick": args.quick,
        "load_average_at_end": load_average(),
    }
    write_json(args.result_file, result)
    plot = draw_structured_output(result, args.result_file.parent)
    print(json.dumps(summary, indent=2))
    print(plot)
    errors = sum(p["errors"] for p in result["phases"])
    if errors:
        logger.error(
            "%d requests failed, e.g. %s",
            errors,
            next(p["first_error"] for p in result["phases"] if p["errors"]),
        )
    return 0 if errors == 0 and validity["valid"] == validity["checked"] else 1
