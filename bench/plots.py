"""Pictures and the README table, drawn from the JSON results only (so they can be redrawn any time).

- `throughput_vs_rate.png`: output tokens/s and p99 TTFT against request rate for every system of the
  sweep, the all-at-once headline as the rightmost point, and the machine's physical limit;
- `cdf_ttft_itl.png`: CDFs of TTFT and ITL of every system on the headline workload;
- `occupancy_timeline.png`: batch slots x iterations, a colour per request, static vs continuous;
- `chunked_prefill_itl.png`: ITL of running streams over time while a long prompt is prefilled, with
  and without chunked prefill;
- `structured_output.png`: per-token ITL of JSON-schema-constrained vs unconstrained streams (CDFs and
  p50/p90 bars) and the share of tokens the grammar forced, by schema (jump-forward potential);
- `README_table.md`: the headline table of `tandem bench compare`, machine, date and command;
- `serving_path.png`: `tandem bench serving-path`'s rounds beside the bare grpc.aio server's, tokens/s
  and CPU per message, with issue 23's targets (0.7x the messages/s, 3x the CPU per message);
- `quantized.png` and `README_quantized_table.md`: `tandem bench quantized`'s precision modes against
  llama-server F32 and Q8_0 (the project README's benchmark table).

    tandem bench plots [--results-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from bench.report import results_dir

INF_LABEL = "all at once"
TANDEM_HEADLINE = "tandem-aggregated"


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(plt, fig, path: Path) -> Path:
    """Lay out, write and close one figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _rate(run: dict) -> float:
    rate = run["arrivals"]["request_rate"]
    return math.inf if rate == "inf" else float(rate)


def _series(compare: dict) -> dict[str, list[tuple[float, dict]]]:
    """Per system: (rate, run) points of the sweep plus its headline run, sorted by rate."""
    by_system: dict[str, list[tuple[float, dict]]] = {}
    sweep_names = {run["system"]["name"] for run in compare["sweep"]}
    for run in compare["sweep"] + [r for r in compare["runs"] if r["system"]["name"] in sweep_names]:
        by_system.setdefault(run["system"]["name"], []).append((_rate(run), run))
    return {name: sorted(points, key=lambda p: p[0]) for name, points in by_system.items()}


def draw_throughput_vs_rate(compare: dict, out: Path) -> Path | None:
    from bench.roofline import rate_bound

    series = _series(compare)
    if not series:
        return None
    finite = sorted({rate for points in series.values() for rate, _ in points if math.isfinite(rate)})
    inf_x = (finite[-1] * 2) if finite else 1.0
    plt = pyplot()
    fig, (ax_tput, ax_ttft) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, points in series.items():
        xs = [inf_x if math.isinf(rate) else rate for rate, _ in points]
        ax_tput.plot(xs, [run["metrics"]["output_throughput"] for _, run in points], marker="o", label=name)
        ax_ttft.plot(
            xs, [run["metrics"]["ttft_ms"]["p99"] or math.nan for _, run in points], marker="o", label=name
        )
    limit = compare.get("physical_limit")
    if limit:
        # The sweep sends a prefix of the headline requests: its offered load uses its own mean output.
        sweep = compare.get("sweep_workload") or compare["workload"]
        sweep_limit = {**limit, "mean_output_len": sweep["output_tokens"] / sweep["num_requests"]}
        xs = [*finite, inf_x]
        ys = [rate_bound(sweep_limit, x) for x in finite] + [limit["output_tok_s_bound"]]
        ax_tput.plot(xs, ys, "k--", label=f"physical limit ({limit['limited_by']}-bound)")
    for ax in (ax_tput, ax_ttft):
        ax.set_xscale("log")
        ax.set_xticks([*finite, inf_x], [*(f"{r:g}" for r in finite), INF_LABEL])
        ax.set_xticks([], minor=True)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    ax_tput.set_ylabel("output tokens/s")
    ax_tput.set_title("throughput vs request rate")
    ax_ttft.set_ylabel("p99 TTFT (ms)")
    ax_ttft.set_yscale("log")
    ax_ttft.set_title("p99 time to first token vs request rate")
    ax_tput.legend(fontsize=8)
    fig.suptitle(_subtitle(compare), fontsize=9)
    return save(plt, fig, out / "throughput_vs_rate.png")


def draw_cdfs(compare: dict, out: Path) -> Path | None:
    if not compare["runs"]:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, title in ((axes[0], "ttft_ms_quantiles", "TTFT"), (axes[1], "itl_ms_quantiles", "ITL")):
        for run in compare["runs"]:
            quantiles = run["distributions"][key]
            if quantiles:
                ax.plot(
                    quantiles,
                    [i / (len(quantiles) - 1) for i in range(len(quantiles))],
                    label=run["system"]["name"],
                )
        ax.set_xscale("log")
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of " + ("requests" if title == "TTFT" else "token gaps"))
        ax.set_title(f"CDF of {title}, all requests at once")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(_subtitle(compare), fontsize=9)
    return save(plt, fig, out / "cdf_ttft_itl.png")


def _subtitle(compare: dict) -> str:
    workload = compare["workload"]
    machine = compare["machine"]
    return (
        f"{compare['config']['model']} fp32, {workload['num_requests']} requests, prompts "
        f"{workload['prompt_len_min']}-{workload['prompt_len_max']} tok, outputs "
        f"{workload['output_len_min']}-{workload['output_len_max']} tok exact; {machine['cpu']}, "
        f"{compare['config']['threads']} threads per system; {machine['date'][:10]}"
    )


def readme_table(compare: dict) -> str:
    """The headline table in markdown: system, output tok/s, ratio vs HF static, p99 TTFT, p99 ITL."""
    from bench.machine import host_label

    runs = compare["runs"]
    base = next((r for r in runs if r["system"]["name"] == compare["config"]["baseline"]), None)
    limit = compare.get("physical_limit")
    lines = [
        "| system | output tok/s | vs HF static | p99 TTFT (ms) | p99 ITL (ms) |",
        "|---|---:|---:|---:|---:|",
    ]
    for run in runs:
        m = run["metrics"]
        ratio = f"{m['output_throughput'] / base['metrics']['output_throughput']:.2f}x" if base else "-"
        ttft, itl = m["ttft_ms"]["p99"], m["itl_ms"]["p99"]
        lines.append(
            f"| {run['system']['name']} | {m['output_throughput']:.1f} | {ratio} | "
            f"{'-' if ttft is None else f'{ttft:,.0f}'} | {'-' if itl is None else f'{itl:,.0f}'} |"
        )
    if limit:
        bound = limit["output_tok_s_bound"]
        lines.append(f"| physical limit ({limit['limited_by']}-bound) | {bound:.1f} | | | |")
    machine = compare["machine"]
    workload = compare["workload"]
    sessions = compare.get("sessions") or [
        {"systems": [r["system"]["name"] for r in runs], "machine": machine, "command": compare["command"]}
    ]
    notes = [
        "",
        f"Workload: {compare['config']['model']} fp32, {workload['num_requests']} requests all at once, "
        f"prompts {workload['prompt_len']} tokens, outputs {workload['output_len']} tokens exact (EOS "
        f"ignored), greedy; seed {workload['seed']}.",
        f"Machine: {host_label(machine)}, {machine['memory_gib']} GiB; "
        f"{compare['config']['threads']} threads per system (split 1+1 across the two disaggregated tiers).",
    ]
    for index, session in enumerate(sessions):
        # A system's numbers come from the last session that measured it.
        later = {name for other in sessions[index + 1 :] for name in other["systems"]}
        shown = [name for name in session["systems"] if name not in later]
        if not shown:
            continue
        measured = session["machine"]
        notes.append(
            f"Measured {', '.join(shown)}: {measured['date']}, commit {measured['git_commit']}, "
            f"load average at start {measured['load_average_1_5_15']}; command: `{session['command']}`"
        )
    tandem = next((r for r in runs if r["system"]["name"] == TANDEM_HEADLINE), None)
    if limit and tandem:
        fraction = tandem["metrics"]["output_throughput"] / limit["output_tok_s_bound"]
        probe = limit["probe"]
        notes.append(
            f"Physical limit: {limit['matmul_tflop']} TFLOP of matmuls at {probe['matmul_gflops']} GFLOP/s "
            f"and {limit['memory_read_gb']} GB of reads at {probe['read_bandwidth_gbs']} GB/s (probed); "
            f"{TANDEM_HEADLINE} reaches {fraction:.0%} of it."
        )
    for name, reason in compare.get("skipped", {}).items():
        notes.append(f"Skipped {name}: {reason}")
    return "\n".join(lines + notes) + "\n"


def draw_occupancy(occupancy: dict, out: Path) -> Path:
    """Rows = batch slots, x = engine iteration, one colour per request; static above continuous."""
    from matplotlib.colors import hsv_to_rgb

    plt = pyplot()
    modes = occupancy["modes"]
    size = (12, 2.2 + 1.6 * len(modes))
    fig, axes = plt.subplots(len(modes), 1, figsize=size, sharex=True, squeeze=False)
    num_requests = occupancy["num_requests"]
    for ax, mode in zip(axes[:, 0], modes, strict=True):
        for slot, step, length, request, kind in mode["segments"]:
            hue = (request * 0.618034) % 1.0
            colour = hsv_to_rgb((hue, 0.65 if kind == "decode" else 0.35, 0.9 if kind == "decode" else 1.0))
            ax.broken_barh([(step, length)], (slot - 0.4, 0.8), facecolors=colour, edgecolors="none")
        ax.set_ylim(-0.6, mode["num_slots"] - 0.4)
        ax.set_xlim(0, max(m["num_steps"] for m in modes))
        ax.set_ylabel("batch slot")
        ax.set_title(
            f"{mode['batching']} batching: {mode['num_steps']} iterations, mean occupancy "
            f"{mode['mean_occupancy']:.0%} of {mode['num_slots']} slots",
            fontsize=10,
        )
    axes[-1, 0].set_xlabel("engine iteration (pale: prefill chunk, strong: decode)")
    fig.suptitle(
        f"batch occupancy from the engine event log: the same {num_requests} requests, "
        f"outputs {occupancy['output_len']} tokens ({occupancy['model']})",
        fontsize=10,
    )
    return save(plt, fig, out / "occupancy_timeline.png")


def draw_chunked_prefill(itl: dict, out: Path) -> Path:
    """ITL of the decode streams against time, one panel per setting, the long prompt's arrival marked."""
    plt = pyplot()
    settings = itl["settings"]
    size = (11, 2.5 + 2 * len(settings))
    fig, axes = plt.subplots(len(settings), 1, figsize=size, sharex=True, squeeze=False)
    for ax, setting in zip(axes[:, 0], settings, strict=True):
        times, gaps = setting["itl_times_s"], setting["itl_ms"]
        ax.scatter(times, gaps, s=6)
        ax.axvline(
            setting["long_prompt_sent_s"],
            color="red",
            linestyle="--",
            label=f"{itl['long_prompt_len']}-token prompt sent",
        )
        if setting.get("long_prompt_first_token_s") is not None:
            ax.axvline(
                setting["long_prompt_first_token_s"], color="green", linestyle=":", label="its first token"
            )
        ax.set_ylabel("ITL (ms)")
        ax.set_title(
            f"{setting['label']} (max-num-batched-tokens {setting['max_num_batched_tokens']}): "
            f"max ITL {max(gaps, default=0):,.0f} ms, p99 {setting['itl_p99_ms']:,.0f} ms",
            fontsize=10,
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    axes[-1, 0].set_xlabel("time since the decode streams started (s)")
    fig.suptitle(
        f"ITL of {itl['num_streams']} running streams while a {itl['long_prompt_len']}-token prompt is "
        f"prefilled ({itl['model']}, {itl['threads']} threads)",
        fontsize=10,
    )
    return save(plt, fig, out / "chunked_prefill_itl.png")


def draw_structured_output(result: dict, out: Path) -> Path:
    """ITL CDFs and p50/p90 bars of constrained vs unconstrained streams; forced-token share by schema."""
    plt = pyplot()
    summary = result["summary"]
    fig, (ax_cdf, ax_bars, ax_jump) = plt.subplots(1, 3, figsize=(15, 4.5))
    for kind, quantiles in result["itl_ms_cdf"].items():
        if quantiles:
            ax_cdf.plot(quantiles, [i / (len(quantiles) - 1) for i in range(len(quantiles))], label=kind)
    ax_cdf.set_xlabel("inter-token latency per token (ms)")
    ax_cdf.set_ylabel("fraction of tokens")
    ax_cdf.set_title("ITL CDF, full-batch window", fontsize=10)
    ax_cdf.legend(fontsize=8)
    bars = [
        ("unconstrained", summary["itl_ms_unconstrained"]),
        ("constrained", summary["itl_ms_constrained"]),
    ]
    if "mixed_itl_ms_constrained" in summary:
        bars += [
            ("mixed: unconstr.", summary["mixed_itl_ms_unconstrained"]),
            ("mixed: constr.", summary["mixed_itl_ms_constrained"]),
        ]
    xs = range(len(bars))
    for offset, quantile in ((-0.2, "p50"), (0.2, "p90")):
        ax_bars.bar([x + offset for x in xs], [q[quantile] or 0 for _, q in bars], width=0.4, label=quantile)
    ax_bars.set_xticks(list(xs), [name for name, _ in bars], fontsize=8)
    ax_bars.set_ylabel("ms per token")
    ax_bars.set_title(
        f"constrained / unconstrained: p50 {summary['itl_ratio_p50']}x, p90 {summary['itl_ratio_p90']}x "
        f"(target <= {summary['itl_ratio_target']}x)",
        fontsize=10,
    )
    ax_bars.legend(fontsize=8)
    per_schema = result["jump_forward"]["per_schema"]
    names = sorted(per_schema)
    ax_jump.barh(names, [per_schema[name]["forced_token_fraction"] for name in names])
    ax_jump.set_xlim(0, 1)
    ax_jump.set_xlabel("tokens inside grammar-forced text")
    ax_jump.set_title(
        f"jump-forward potential: {result['jump_forward']['forced_token_fraction']:.0%} of tokens forced",
        fontsize=10,
    )
    for ax in (ax_cdf, ax_bars, ax_jump):
        ax.grid(alpha=0.3)
    workload = result["workload"]
    fig.suptitle(
        f"JSON-schema-constrained vs unconstrained decoding, {workload['streams']} concurrent streams, "
        f"max {workload['max_tokens']} tokens ({result['model']})",
        fontsize=10,
    )
    return save(plt, fig, out / "structured_output.png")


def draw_serving_path(result: dict, out: Path) -> Path | None:
    """Each round's served tokens/s and server CPU per token beside the bare server's rounds (one token
    per message), with the targets drawn from the bare server's medians; None without a bare run."""
    bare = result.get("bare_grpc")
    if not bare:
        return None
    plt = pyplot()
    summary = result["summary"]
    fig, (ax_rate, ax_cpu) = plt.subplots(1, 2, figsize=(11, 4))
    rounds = {"tandem": result["rounds"], "bare grpc.aio": bare["rounds"]}
    for offset, (name, rows) in zip((-0.2, 0.2), rounds.items(), strict=True):
        xs = [index + 1 + offset for index in range(len(rows))]
        ax_rate.bar(xs, [row["served_tok_s"] for row in rows], width=0.4, label=name)
        ax_cpu.bar(xs, [row["server_cpu_us_per_token"] for row in rows], width=0.4, label=name)
    ax_rate.axhline(0.7 * bare["msgs_per_s"], color="k", ls="--", lw=1, label="target: 0.7x bare median")
    ax_cpu.axhline(3 * bare["cpu_us_per_message"], color="k", ls="--", lw=1, label="target: 3x bare median")
    ax_rate.set_ylabel("tokens/s (bare: messages/s)")
    ax_cpu.set_ylabel("server CPU µs per token (bare: per message)")
    # No ratios for a stream interval above 1 or a run shorter than the CPU clock's tick (see the summary).
    rate_ratio = summary.get("msgs_per_s_vs_bare", "-")
    ax_rate.set_title(f"served rate: median {rate_ratio}x bare", fontsize=10)
    ax_cpu.set_title(f"server CPU: median {summary.get('cpu_per_message_vs_bare', '-')}x bare", fontsize=10)
    for ax in (ax_rate, ax_cpu):
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    workload, model = result["workload"], result["model"]
    fig.suptitle(
        f"serving path: {workload['streams']} streams x {workload['output_len']} tokens over "
        f"{workload['api']}, near-zero model (vocabulary {model['vocab_size']}), "
        f"{result['machine']['date'][:16]}",
        fontsize=10,
    )
    return save(plt, fig, out / "serving_path.png")


def quantized_table(document: dict) -> str:
    """`tandem bench quantized`'s README table: a row per system, then the ratios and how it was measured."""
    from bench.machine import host_label

    lines = [
        "| system | single-stream decode tok/s | multi-turn chat tok/s | multi-turn median TTFT (ms) "
        "| all-at-once tok/s | peak RSS (MiB) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for run in document["runs"]:
        lines.append(
            f"| {run['label']} | {run['single_decode_tok_s']:.1f} | {run['multi_turn_tok_s']:.1f} "
            f"| {run['multi_turn_median_ttft_ms']:,.0f} | {run['headline_tok_s']:.1f} "
            f"| {run['peak_rss_bytes'] / 2**20:,.0f} |"
        )
    lines.append("")
    found = document.get("ratios")
    if found:
        lines.append(
            f"tandem int8 / llama-server Q8_0: single-stream decode {found['single_decode']:.2f}x, "
            f"multi-turn throughput {found['multi_turn_throughput']:.2f}x and median TTFT "
            f"{found['multi_turn_median_ttft']:.2f}x, all-at-once {found['headline_throughput']:.2f}x."
        )
    alternated = document.get("single_alternated")
    if alternated:
        lines.append(
            f"Single-stream decode with both servers up, the workload sent to each in turn "
            f"{len(alternated['rounds'])} times: tandem int8 / llama-server Q8_0 median "
            f"{alternated['median_ratio']:.2f}x (rounds {alternated['min_ratio']:.2f}-"
            f"{alternated['max_ratio']:.2f}x)."
        )
    workloads = document["workloads"]
    chat, single, headline = workloads["chat"], workloads["single"], workloads["headline"]
    machine = document["machine"]
    lines += [
        f"Workloads: multi-turn {chat['conversations']} conversations x {chat['turns']} turns (a shared "
        f"{chat['system_len']}-token system prompt, {chat['user_len']}-token user turns, {chat['reply_len']}"
        f"-token replies, history resent); single stream {single['num_requests']} requests one at a time, "
        f"prompts {single['prompt_len']}, outputs {single['output_len']}; all at once "
        f"{headline['num_requests']} requests, prompts {headline['prompt_len']}, outputs "
        f"{headline['output_len']}. Greedy, EOS ignored, {document['model']}.",
        f"Machine: {host_label(machine)}; "
        f"{document['threads']} threads per system. Measured {document['started']}, "
        f"commit {document['commit']}, load average "
        f"{document['load_average_at_start']} at start and {document['load_average_at_end']} at the end"
        f"{'' if document['valid'] else ' (busy machine: not a valid comparison)'}; command: "
        f"`{document['command']}`.",
    ]
    return "\n".join(lines) + "\n"


def draw_quantized(document: dict, out_dir: Path) -> Path:
    """`tandem bench quantized`'s figures, a panel each, a bar per system."""
    plt = pyplot()
    figures = (
        ("single_decode_tok_s", "single-stream decode tok/s"),
        ("multi_turn_tok_s", "multi-turn chat tok/s"),
        ("multi_turn_median_ttft_ms", "multi-turn median TTFT (ms)"),
        ("headline_tok_s", "all-at-once tok/s"),
        ("peak_rss_bytes", "peak RSS (MiB)"),
    )
    runs = document["runs"]
    fig, axes = plt.subplots(1, len(figures), figsize=(4 * len(figures), 4))
    for ax, (key, title) in zip(axes, figures, strict=True):
        values = [run[key] / (2**20 if key == "peak_rss_bytes" else 1) for run in runs]
        colours = ["tab:blue" if run["system"].startswith("tandem") else "tab:gray" for run in runs]
        ax.bar(range(len(runs)), values, color=colours)
        ax.set_xticks(range(len(runs)), [run["label"] for run in runs], rotation=45, ha="right")
        ax.set_title(title)
    return save(plt, fig, out_dir / "quantized.png")


def draw_comparison(compare_path: Path, out: Path) -> list[Path]:
    compare = json.loads(compare_path.read_text())
    written = [p for p in (draw_throughput_vs_rate(compare, out), draw_cdfs(compare, out)) if p]
    table = out / "README_table.md"
    table.write_text(readme_table(compare))
    return [*written, table]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results-dir", type=Path, default=results_dir())


def run(args: argparse.Namespace) -> int:
    out: Path = args.results_dir
    written: list[Path] = []
    if (out / "compare.json").is_file():
        written += draw_comparison(out / "compare.json", out)
    if (out / "occupancy.json").is_file():
        written.append(draw_occupancy(json.loads((out / "occupancy.json").read_text()), out))
    if (out / "chunked_prefill.json").is_file():
        written.append(draw_chunked_prefill(json.loads((out / "chunked_prefill.json").read_text()), out))
    if (out / "structured_output.json").is_file():
        written.append(draw_structured_output(json.loads((out / "structured_output.json").read_text()), out))
    if (out / "quantized.json").is_file():
        document = json.loads((out / "quantized.json").read_text())
        (out / "README_quantized_table.md").write_text(quantized_table(document))
        written += [draw_quantized(document, out), out / "README_quantized_table.md"]
    for path in written:
        print(path)
    return 0 if written else 1
