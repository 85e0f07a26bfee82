"""Per-turn summaries of agent sessions, their ratios to a baseline, the target, the table."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks._agent_client import TurnRecord

# The target: from turn 2 on, first tokens >= 5x faster than with the cache off,
# and no slower than any peer on any turn.
NOCACHE_SPEEDUP = 5.0
NOCACHE_FROM_TURN = 2


def _median(values: list[float | int | None], digits: int = 1) -> float | None:
    xs = [v for v in values if v is not None]
    return round(float(statistics.median(xs)), digits) if xs else None


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1000.0


def summarize_turns(records: list[list[TurnRecord]], turns: int) -> list[dict[str, Any]]:
    """One run (every session of one repeat): per turn, medians across sessions."""
    out = []
    for t in range(1, turns + 1):
        recs = [r for session in records for r in session if r.turn == t]
        ok = [r for r in recs if r.ok]
        out.append(
            {
                "turn": t,
                "sessions": len(records),
                "failures": len(records) - len(ok),  # failed, or never sent
                "errors": sorted({r.error for r in recs if r.error})[:3],
                "ttft_ms": _median([_ms(r.ttft) for r in ok]),
                "ttft_ms_max": _median([max(_ms(r.ttft) or 0.0 for r in ok)] if ok else []),
                "total_ms": _median([_ms(r.total) for r in ok]),
                "prompt_tokens": _median([r.prompt_tokens for r in ok], 0),
                "cached_tokens": _median([r.cached_tokens for r in ok], 0),
                "completion_tokens": _median([r.completion_tokens for r in ok], 0),
            }
        )
    return out


MEDIAN_KEYS = ("ttft_ms", "ttft_ms_max", "total_ms", "prompt_tokens", "cached_tokens")


def merge_runs(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per turn, the median over repeats of each run's value; failures are summed."""
    merged = []
    for turn_runs in zip(*runs, strict=True):
        row = dict(turn_runs[0])
        for key in (*MEDIAN_KEYS, "completion_tokens"):
            row[key] = _median([r[key] for r in turn_runs], 0 if "tokens" in key else 1)
        row["failures"] = sum(r["failures"] for r in turn_runs)
        row["errors"] = sorted({e for r in turn_runs for e in r["errors"]})[:3]
        row["ttft_ms_runs"] = [r["ttft_ms"] for r in turn_runs]
        merged.append(row)
    return merged


def turn_ratio(row: dict[str, Any], base: dict[str, Any]) -> float | None:
    """TTFT of ``row`` over the baseline's at one turn: the median of the per-repeat ratios
    when both have every repeat (each pair measured close together), else of the medians."""
    runs, base_runs = row.get("ttft_ms_runs") or [], base.get("ttft_ms_runs") or []
    pairs = [a / b for a, b in zip(runs, base_runs, strict=False) if a and b]
    if pairs and len(pairs) == len(runs) == len(base_runs):
        return round(float(statistics.median(pairs)), 2)
    if row.get("ttft_ms") and base.get("ttft_ms"):
        return round(row["ttft_ms"] / base["ttft_ms"], 2)
    return None


def ratios(sources: dict[str, list[dict[str, Any]]], baseline: str) -> dict[str, list[Any]]:
    """Per source other than the baseline: its TTFT / the baseline's, turn by turn."""
    base = sources.get(baseline)
    if not base:
        return {}
    return {
        name: [turn_ratio(row, b) for row, b in zip(turns, base, strict=False)]
        for name, turns in sources.items()
        if name != baseline and turns
    }


def is_nocache(name: str) -> bool:
    return name.endswith("nocache")


def target_check(by_source: dict[str, list[float | None]], baseline: str) -> list[str]:
    """The issue's target as lines: for a ``*nocache`` source, ratio >= 5 from turn 2 on;
    for any other source (a peer), ratio >= 1 on every turn."""
    lines = []
    for name, values in by_source.items():
        need, first = (NOCACHE_SPEEDUP, NOCACHE_FROM_TURN) if is_nocache(name) else (1.0, 1)
        checked = [(t, v) for t, v in enumerate(values, 1) if t >= first]
        missing = [t for t, v in checked if v is None]
        short = [(t, v) for t, v in checked if v is not None and v < need]
        verdict = "met" if not short and not missing else "NOT met"
        detail = ", ".join(f"turn {t}: {v:.2f}x" for t, v in short)
        if missing:
            detail += (", " if detail else "") + f"no data for turns {missing}"
        lines.append(
            f"- {name}/{baseline} >= {need:g}x from turn {first}: {verdict}"
            + (f" ({detail})" if detail else "")
        )
    return lines


def _fmt(x: Any, digits: int = 1) -> str:
    if x is None:
        return "-"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def markdown_table(
    sources: dict[str, list[dict[str, Any]]], by_source: dict[str, list[float | None]]
) -> str:
    """Rows: turns. Columns: prompt tokens, TTFT per source (cached tokens in brackets where
    reported), then each source's TTFT over the baseline's."""
    names = [n for n, turns in sources.items() if turns]
    if not names:
        return "(no results)"
    head = ["turn", "prompt tok"] + [f"{n} TTFT ms" for n in names]
    head += [f"{n}/base" for n in by_source]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, row in enumerate(sources[names[0]]):
        cells = [str(row["turn"]), _fmt(row["prompt_tokens"], 0)]
        for n in names:
            r = sources[n][i]
            cell = _fmt(r["ttft_ms"])
            if r["cached_tokens"] is not None:
                cell += f" [{r['cached_tokens']:.0f}]"
            if r["failures"]:
                cell += f" ({r['failures']} failed)"
            cells.append(cell)
        cells += [
            _fmt(v, 2) + ("x" if v is not None else "")
            for v in (by_source[n][i] for n in by_source)
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
