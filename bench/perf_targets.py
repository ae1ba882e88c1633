"""Issue 17's targets, the figures a perf report measures against them, and how the report is written down.

Pure: no measuring here, so the verdicts, the markdown table and the JSON shape can be tested without
running a server. `bench.perf_report` measures and fills the figures in.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import asdict, dataclass

SCHEMA_VERSION = 1

# The serving path before issue 17's work, as the issue recorded it: 128 concurrent streams x 128 greedy
# tokens over gRPC, the near-zero-cost model (3 layers, hidden 64, the SmolLM2 tokenizer), measured on
# 2026-11-30 on this machine kind (2 shared cores) with `tandem bench serving-path`'s method.
SERVING_PATH_BEFORE = {
    "server_cpu_us_per_token": 365.0,
    "served_tok_s": 2242.0,
    "source": "issue 17, measured 2026-11-30 on this machine kind (365 ms CPU per 1,000 tokens, 2,242 tok/s)",
}

_COMPARATORS = {">=": operator.ge, "<=": operator.le}
_SYMBOLS = {">=": "≥", "<=": "≤"}


@dataclass(frozen=True)
class Target:
    """A bound a figure must meet: `value op threshold`."""

    op: str
    threshold: float

    def __post_init__(self) -> None:
        if self.op not in _COMPARATORS:
            raise ValueError(f"target operator must be one of {sorted(_COMPARATORS)}, not {self.op!r}")

    def met(self, value: float | None) -> bool | None:
        """True or False; None when the figure was not measured (no verdict, rather than a failure)."""
        return None if value is None else _COMPARATORS[self.op](value, self.threshold)

    def __str__(self) -> str:
        return f"{_SYMBOLS[self.op]} {format_number(self.threshold)}"


# Issue 17's targets, by figure kind.
SERVER_CPU_PER_TOKEN = Target("<=", 60.0)
SERVED_TOK_S = Target(">=", 15_000.0)
SINGLE_STREAM_RATIO = Target(">=", 1.0)
KV_GBPS_AT_4K = Target(">=", 1.0)
DISAGG_TTFT_RATIO = Target("<=", 1.2)
HEADLINE_RATIO = Target(">=", 2.0)


@dataclass(frozen=True)
class Figure:
    """One measured number of the report, its target if it has one, and what stops it where it misses."""

    section: str
    name: str
    value: float | None
    unit: str
    target: Target | None = None
    before: float | None = None
    note: str = ""

    def row(self) -> dict:
        """The JSON form: the verdict is computed here, once, from the value and the target."""
        fields = asdict(self)
        fields["target"] = str(self.target) if self.target else None
        fields["met"] = self.target.met(self.value) if self.target else None
        return fields


def format_number(value: float | None) -> str:
    """Readable at a glance: thousands separated, at most three significant decimals for small values."""
    if value is None:
        return "—"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def _verdict(met: bool | None, has_target: bool) -> str:
    if not has_target:
        return ""
    return {True: "met", False: "**not met**", None: "not measured"}[met]


def render_markdown(report: dict) -> str:
    """The report as a markdown page: the run's conditions, then one table row per figure."""
    load_before, load_after = report["load_average_before"], report["load_average_after"]
    sized = " (quick, sized down)" if report["quick"] else ""
    validity = "valid" if report["valid"] else f"**not valid**: {report['invalid_reason']}"
    lines = [
        "# tandem performance report (issue 17)",
        "",
        f"`{report['command']}`",
        "",
        f"- machine: {report['machine']['cpu']}, {report['machine']['cores']} cores; commit "
        f"{report['machine'].get('git_commit')}; {report['machine']['date']}",
        f"- load average (1/5/15 min) before {load_before}, after {load_after}; run {validity}",
        f"- sections: {', '.join(report['sections_run'])}{sized}; {report['duration_s']:.0f} s",
        "",
        "| section | figure | before | measured | target | verdict | reason and bound |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report["figures"]:
        unit = f" {row['unit']}" if row["unit"] else ""
        before = f"{format_number(row['before'])}{unit}" if row["before"] is not None else ""
        lines.append(
            f"| {row['section']} | {row['name']} | {before} | {format_number(row['value'])}{unit} "
            f"| {row['target'] or ''} | {_verdict(row['met'], row['target'] is not None)} | {row['note']} |"
        )
    skipped = report.get("skipped", {})
    if skipped:
        lines += ["", *(f"- {name} not run: {reason}" for name, reason in skipped.items())]
    return "\n".join(lines) + "\n"


def figure_rows(figures: Sequence[Figure]) -> list[dict]:
    return [figure.row() for figure in figures]


# The JSON document `tandem bench perf-report` writes (checked by the tests with jsonschema).
REPORT_SCHEMA: dict = {
    "type": "object",
    "required": [
        "schema_version",
        "benchmark",
        "command",
        "machine",
        "load_average_before",
        "load_average_after",
        "valid",
        "invalid_reason",
        "quick",
        "sections_run",
        "duration_s",
        "figures",
        "sections",
        "skipped",
    ],
    "properties": {
        "schema_version": {"const": SCHEMA_VERSION},
        "benchmark": {"const": "perf_report"},
        "command": {"type": "string"},
        "machine": {"type": "object", "required": ["cpu", "cores", "date"]},
        "load_average_before": {"type": "array", "items": {"type": "number"}, "minItems": 3, "maxItems": 3},
        "load_average_after": {"type": "array", "items": {"type": "number"}, "minItems": 3, "maxItems": 3},
        "valid": {"type": "boolean"},
        "invalid_reason": {"type": ["string", "null"]},
        "quick": {"type": "boolean"},
        "sections_run": {"type": "array", "items": {"enum": ["serving", "single", "kv", "headline"]}},
        "duration_s": {"type": "number", "minimum": 0},
        "figures": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["section", "name", "value", "unit", "target", "met", "before", "note"],
                "properties": {
                    "section": {"type": "string"},
                    "name": {"type": "string"},
                    "value": {"type": ["number", "null"]},
                    "unit": {"type": "string"},
                    "target": {"type": ["string", "null"]},
                    "met": {"type": ["boolean", "null"]},
                    "before": {"type": ["number", "null"]},
                    "note": {"type": "string"},
                },
            },
        },
        "sections": {"type": "object"},
        "skipped": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}
