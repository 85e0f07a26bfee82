"""Per-request records, per-level summaries, machine info and the Markdown report."""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import platform
import statistics
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    """One request as the load generator (or the in-process loop) saw it.

    Times are seconds from ``time.perf_counter()``; ``chunk_times`` are the arrival times
    of chunks that carried content (a chunk may hold several tokens).
    """

    start: float
    end: float = 0.0
    ok: bool = False
    error: str | None = None
    status: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    chunk_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def itl(self) -> float | None:
        """Mean inter-token latency of this request: decode span over tokens after the first."""
        n = self.completion_tokens or 0
        if len(self.chunk_times) < 2 or n < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (n - 1)

    def gaps(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 100]; None for no data."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize_level(
    records: list[RequestRecord], wall_s: float, concurrency: int, max_tokens: int
) -> dict[str, Any]:
    """Metrics of one run of one concurrency level."""
    tokens = sum(r.completion_tokens or 0 for r in records)
    ttfts = [r.ttft for r in records if r.ok and r.ttft is not None]
    itls = [r.itl for r in records if r.ok and r.itl is not None]
    gaps = [g for r in records if r.ok for g in r.gaps()]
    chunks = sum(len(r.chunk_times) for r in records if r.ok)
    ok_tokens = sum(r.completion_tokens or 0 for r in records if r.ok)
    prompt = [r.prompt_tokens for r in records if r.prompt_tokens is not None]
    errors: dict[str, int] = {}
    samples: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = (r.error or "unknown").split(":", 1)[0]
            errors[key] = errors.get(key, 0) + 1
            samples[r.error or "unknown"] = samples.get(r.error or "unknown", 0) + 1

    def ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1000.0, 3)

    return {
        "concurrency": concurrency,
        "requests": len(records),
        "failures": sum(1 for r in records if not r.ok),
        "errors": errors,
        "error_samples": dict(sorted(samples.items(), key=lambda kv: -kv[1])[:5]),
        "wall_s": round(wall_s, 4),
        "completion_tokens": tokens,
        "output_tok_s": round(tokens / wall_s, 3) if wall_s > 0 else None,
        "ttft_p50_ms": ms(percentile(ttfts, 50)),
        "ttft_p95_ms": ms(percentile(ttfts, 95)),
        "itl_p50_ms": ms(percentile(itls, 50)),
        "itl_p95_ms": ms(percentile(itls, 95)),
        "ttft_mean_ms": ms(sum(ttfts) / len(ttfts) if ttfts else None),
        "itl_mean_ms": ms(sum(itls) / len(itls) if itls else None),
        "gap_p50_ms": ms(percentile(gaps, 50)),
        "gap_p95_ms": ms(percentile(gaps, 95)),
        "gap_max_ms": ms(max(gaps) if gaps else None),
        "tokens_per_chunk": round(ok_tokens / chunks, 3) if chunks else None,
        "prompt_tokens_min": min(prompt) if prompt else None,
        "prompt_tokens_max": max(prompt) if prompt else None,
        "max_tokens": max_tokens,
        "loadavg_1m_end": round(os.getloadavg()[0], 2),
    }


MEDIAN_KEYS = (
    "wall_s",
    "output_tok_s",
    "ttft_p50_ms",
    "ttft_p95_ms",
    "itl_p50_ms",
    "itl_p95_ms",
    "gap_p50_ms",
    "gap_p95_ms",
    "gap_max_ms",
    "tokens_per_chunk",
    "client_cpu_pct",
    "server_cpu_pct",
    "system_cpu_pct",
    "other_cpu_pct",
    "steal_pct",
    "server_rss_mb",
    "gpu_busy_pct",
)


def combine_repeats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of each metric across repeats; counts are summed."""
    out = dict(runs[0])
    for key in MEDIAN_KEYS:
        vals = [r[key] for r in runs if r.get(key) is not None]
        out[key] = round(statistics.median(vals), 3) if vals else None
    for key in ("requests", "failures", "completion_tokens"):
        out[key] = sum(r[key] for r in runs)
    out["discarded"] = [d for r in runs for d in r.get("discarded", [])]
    out["contended"] = sum(bool(r.get("contended")) for r in runs)
    for key in ("errors", "error_samples"):
        merged: dict[str, int] = {}
        for r in runs:
            for k, v in r.get(key, {}).items():
                merged[k] = merged.get(k, 0) + v
        out[key] = merged
    mins = [r["prompt_tokens_min"] for r in runs if r["prompt_tokens_min"] is not None]
    maxs = [r["prompt_tokens_max"] for r in runs if r["prompt_tokens_max"] is not None]
    out["prompt_tokens_min"] = min(mins) if mins else None
    out["prompt_tokens_max"] = max(maxs) if maxs else None
    out["repeats"] = len(runs)
    out["output_tok_s_runs"] = [r["output_tok_s"] for r in runs]
    return out


def merge_repeats(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-repeat results of one source -> one result whose levels are medians over repeats."""
    by_level: dict[int, list[dict[str, Any]]] = {}
    for res in results:
        for lv in res.get("levels", []):
            by_level.setdefault(lv["concurrency"], []).append(lv)
    levels = []
    for c in sorted(by_level):
        # not popped: a run's results are merged again each time a source finishes
        raws = [run["raw"] for run in by_level[c] if "raw" in run]
        runs = [{k: v for k, v in run.items() if k != "raw"} for run in by_level[c]]
        level = combine_repeats(runs)
        level["runs"] = runs
        if raws:
            level["raw"] = raws
        levels.append(level)
    merged = {k: v for k, v in results[0].items() if k != "levels"}
    errors = [res["error"] for res in results if res.get("error")]
    if errors:
        merged["error"] = errors[0]
    merged["per_repeat"] = [{k: v for k, v in r.items() if k != "levels"} for r in results]
    merged["levels"] = levels
    return merged


def record_to_dict(r: RequestRecord) -> dict[str, Any]:
    d = asdict(r)
    d["ttft"] = r.ttft
    d["itl"] = r.itl
    return d


def level_ratio(level: dict[str, Any], base: dict[str, Any] | None) -> float | None:
    """Throughput against the ceiling at one level: the median of the per-repeat ratios when
    both have one run per repeat (each pair measured back to back when interleaved, so the
    machine's drift between repeats cancels), else the ratio of the medians."""
    if base is None or not base.get("output_tok_s") or level.get("output_tok_s") is None:
        return None
    runs, base_runs = level.get("runs") or [], base.get("runs") or []
    pairs = [
        run["output_tok_s"] / b["output_tok_s"]
        for run, b in zip(runs, base_runs, strict=False)
        if run.get("output_tok_s") and b.get("output_tok_s")
    ]
    if len(runs) == len(base_runs) and len(pairs) == len(runs) and pairs:
        return float(statistics.median(pairs))
    return float(level["output_tok_s"] / base["output_tok_s"])


def table_rows(model_result: dict[str, Any]) -> list[dict[str, Any]]:
    ceiling = {lv["concurrency"]: lv for lv in model_result.get("inprocess", {}).get("levels", [])}
    rows = []
    sources = []
    if "inprocess" in model_result:
        sources.append(("inprocess", model_result["inprocess"]))
    sources += list(model_result["targets"].items())
    for name, res in sources:
        for lv in res.get("levels", []):
            row = dict(lv, target=name)
            row["ratio"] = level_ratio(lv, ceiling.get(lv["concurrency"]))
            lv["ratio_to_inprocess"] = None if row["ratio"] is None else round(row["ratio"], 4)
            rows.append(row)
    rows.sort(key=lambda r: (r["concurrency"], r["target"] != "inprocess"))
    return rows


# --- machine info --------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_info(blas: str | None) -> dict[str, Any]:
    mem = None
    with contextlib.suppress(ValueError, OSError, AttributeError):
        mem = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": mem,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mlx": _version("mlx"),
        "mlx_cpu": _version("mlx-cpu"),
        "mlx_lm": _version("mlx-lm"),
        "aiohttp": _version("aiohttp"),
        "blas_preload": blas,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }


# --- Markdown ------------------------------------------------------------------------------


def _fmt(x: Any, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _pair(a: Any, b: Any) -> str:
    return f"{_fmt(a)} / {_fmt(b)}"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """rows: dicts with 'target' plus a combined level summary and optional 'ratio'."""
    head = (
        "| target | conc | out tok/s | vs in-process | TTFT p50/p95 ms | ITL p50/p95 ms "
        "| chunk gap p50/p95 ms | tok/chunk | prompt tok | fail/req | bg CPU % | steal % "
        "| GPU busy % |"
    )
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        ratio = r.get("ratio")
        ptok = (
            f"{r['prompt_tokens_min']}-{r['prompt_tokens_max']}"
            if r.get("prompt_tokens_min") is not None
            and r["prompt_tokens_min"] != r["prompt_tokens_max"]
            else _fmt(r.get("prompt_tokens_min"))
        )
        cells = (
            "| {t} | {c} | {tps} | {ratio} | {ttft} | {itl} | {gap} | {tpc} | {ptok} "
            "| {f}/{n} | {bg} | {steal} | {gpu} |"
        )
        lines.append(
            cells.format(
                t=r["target"],
                c=r["concurrency"],
                tps=_fmt(r.get("output_tok_s")),
                ratio="-" if ratio is None else f"{ratio:.2f}",
                ttft=_pair(r.get("ttft_p50_ms"), r.get("ttft_p95_ms")),
                itl=_pair(r.get("itl_p50_ms"), r.get("itl_p95_ms")),
                gap=_pair(r.get("gap_p50_ms"), r.get("gap_p95_ms")),
                tpc=_fmt(r.get("tokens_per_chunk"), 2),
                ptok=ptok,
                f=r["failures"],
                n=r["requests"],
                bg=_fmt(r.get("other_cpu_pct"), 0),
                steal=_fmt(r.get("steal_pct"), 0),
                gpu=_fmt(r.get("gpu_busy_pct"), 0),
            )
        )
    return "\n".join(lines)


def machine_header(info: dict[str, Any]) -> str:
    return (
        f"- machine: {info['cpu']}, {info['cores']} cores "
        f"(affinity {info['affinity']}), {info['memory_gib']} GiB, {info['platform']}\n"
        f"- python {info['python']}, mlx {info['mlx']} (mlx-cpu {info['mlx_cpu']}), "
        f"mlx-lm {info['mlx_lm']}, aiohttp {info['aiohttp']}\n"
        f"- BLAS preload: {info['blas_preload'] or 'none'}; "
        f"load average at start: {info['loadavg_start']}"
    )
