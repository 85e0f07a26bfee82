"""Machine-wide CPU use from /proc/stat, to spot other processes competing for the cores.

Percentages are in units of one core (200 = two cores busy), like a process's CPU %.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, NamedTuple


class Sample(NamedTuple):
    """Jiffies over all CPUs since boot."""

    busy: int  # this machine's processes and kernel
    steal: int  # a virtual machine's: its vCPUs wanted to run and the host ran others
    total: int


def snapshot() -> Sample | None:
    """The machine's CPU counters, or None where /proc/stat is missing."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + fields[4]  # idle + iowait
    steal = fields[7]
    total = sum(fields)
    return Sample(total - idle - steal, steal, total)


def _pct(a: Sample | None, b: Sample | None, field: str) -> float | None:
    if a is None or b is None or b.total <= a.total:
        return None
    used = getattr(b, field) - getattr(a, field)
    return round(100.0 * (os.cpu_count() or 1) * used / (b.total - a.total), 1)


def busy_pct(a: Sample | None, b: Sample | None) -> float | None:
    """CPU this machine's processes used between two samples."""
    return _pct(a, b, "busy")


def steal_pct(a: Sample | None, b: Sample | None) -> float | None:
    """CPU the host withheld between two samples (a VM's steal time): the measured code ran
    slower for it, whatever the code. Runs with very different steal are not comparable."""
    return _pct(a, b, "steal")


def contended(summary: dict[str, Any], max_steal: float | None) -> bool:
    """A level measured while the host withheld more than `max_steal` % of a core."""
    steal = summary.get("steal_pct")
    return max_steal is not None and steal is not None and steal > max_steal


def discarded(summary: dict[str, Any]) -> dict[str, Any]:
    """What is kept of a level measured again for steal."""
    keys = ("output_tok_s", "ttft_p50_ms", "itl_p50_ms", "steal_pct", "failures")
    return {k: summary.get(k) for k in keys}


def least_stolen(tried: list[dict[str, Any]], max_steal: float | None) -> dict[str, Any]:
    """Of a level's attempts, the one measured at the least steal; the others are kept
    under its `discarded`, and `contended` says whether even it was over the limit."""
    best = min(tried, key=lambda s: s.get("steal_pct") or 0.0)
    best["discarded"] = [discarded(s) for s in tried if s is not best]
    best["contended"] = contended(best, max_steal)
    return best


def wait_idle(max_wait: float, threshold: float, label: str) -> dict[str, float | None]:
    """Wait (bounded by ``max_wait`` seconds) until the machine's CPU use over a 1 s window
    is below ``threshold`` % of one core; returns what was seen."""
    start = time.perf_counter()
    seen: float | None = None
    for _ in range(int(max_wait) + 1):
        a = snapshot()
        time.sleep(1.0)
        seen = busy_pct(a, snapshot())
        if seen is None or seen < threshold:
            break
        if time.perf_counter() - start >= max_wait:
            print(
                f"[{label}] machine still busy ({seen}% CPU) after {max_wait:.0f}s; "
                "measuring anyway (see bg CPU % in the table)",
                file=sys.stderr,
            )
            break
    return {"idle_wait_s": round(time.perf_counter() - start, 1), "busy_before_pct": seen}
