"""What `gatewayctl ps` and `gatewayctl status` show of the admin API's answers."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from gateway.ctl import term

HEADER = (
    "MODEL",
    "KIND",
    "STATE",
    "PID",
    "MEMORY",
    "RUNNING",
    "WAITING",
    "SERVED",
    "RESTARTS",
    "UPTIME",
    "TTL LEFT",
    "PREFIX CACHE",
    "PROMPT MEMO",
)


def table(rows: list[dict[str, Any]]) -> Table:
    grid = term.table(HEADER)
    for r in rows:
        memory = r.get("memory_bytes") or r.get("rss_bytes")
        ttl_left = r.get("ttl_left_s")
        if r.get("ttl_s") is None:
            ttl = "never"  # no TTL: stays loaded
        else:
            ttl = duration(ttl_left) if ttl_left is not None else "-"  # busy or unloaded
        grid.add_row(
            r["model"],
            str(r.get("kind", "-")),
            r["state"],
            str(r["pid"] or "-"),
            f"{memory / 2**20:.0f} MiB" if memory else "-",
            str(r["running"]),
            str(r["waiting"]),
            str(r.get("served", 0)),
            str(r.get("restarts", 0)),
            duration(r.get("uptime_s")),
            ttl,
            prefix_cache(r.get("prefix_cache")),
            prompt_segments(r.get("prompt_segments")),
        )
    return grid


REPLICA_HEADER = (
    "MODEL",
    "WORKER",
    "HOST",
    "KEY",
    "STATE",
    "PID",
    "RUNNING",
    "WAITING",
    "REQUESTS",
    "CACHE HITS",
)


def has_replicas(rows: list[dict[str, Any]]) -> bool:
    """Whether any model has a worker on another machine (then each worker gets a row)."""
    return any(rep.get("key") for r in rows for rep in r.get("replicas") or [])


def replicas(rows: list[dict[str, Any]]) -> Table:
    """Each model's workers, this machine's and others': host, state, load, cache hits."""
    grid = term.table(REPLICA_HEADER)
    for r in rows:
        for rep in r.get("replicas") or []:
            hits = rep.get("cache_hits")
            grid.add_row(
                r["model"],
                rep["worker_id"],
                rep["host"],
                rep.get("key") or "-",
                rep["state"],
                str(rep.get("pid") or "-"),
                str(rep.get("running", 0)),
                str(rep.get("waiting", 0)),
                str(rep.get("requests", 0)),
                "-" if hits is None else f"{hits} ({rep.get('cache_hit_tokens', 0)} tokens)",
            )
    return grid


def notes(rows: list[dict[str, Any]]) -> list[str]:
    """Lines under the table: why a model failed, when a backing-off one tries again, a
    replica lost, a prefix cache too small for the prompts it was given."""
    out = []
    for r in rows:
        if r.get("error"):
            out.append(f"{r['model']}: {r['error']}")
        elif r.get("next_attempt_s") is not None:
            out.append(
                f"{r['model']}: backing off: {r.get('last_error')}; next attempt in "
                f"{duration(r['next_attempt_s'])}"
            )
        else:
            continue
        if r.get("exit_code") is not None:
            out.append(f"  exit status {r['exit_code']}; `gatewayctl logs {r['model']}`")
    for r in rows:
        for rep in r.get("replicas") or []:
            if rep.get("state") == "lost":
                out.append(f"{r['model']}: worker {rep['worker_id']} lost: {rep.get('error')}")
    for r in rows:
        if oversize := (r.get("prefix_cache") or {}).get("oversize"):
            out.append(
                f"{r['model']}: {oversize} request(s) had more KV than its prefix cache's bound "
                "and were not kept (engine.prefix_cache_gb)"
            )
    return out


def plain(rows: list[dict[str, Any]]) -> str:
    """The table and its notes as plain text (what `ps` prints when not on a terminal)."""
    parts = [term.plain(table(rows))]
    if has_replicas(rows):
        parts.append(term.plain(replicas(rows)))
    return "\n".join([*parts, *notes(rows)])


def prefix_cache(stats: dict[str, int] | None) -> str:
    """1.2/2.0 GiB 63% hit: held of its bound, and the share of lookups that reused a prefix."""
    if not stats:
        return "-"
    units = ((" GiB", 2**30), (" MiB", 2**20))
    held, bound = stats.get("nbytes", 0), stats.get("capacity_bytes", 0)
    return _held(held, bound, units, stats.get("hits", 0), stats.get("lookups", 0))


def prompt_segments(stats: dict[str, int] | None) -> str:
    """3.1/32.0 MiB 92% hit: what the memo holds of its bound, and the share of prompt
    segments found in it (not encoded)."""
    if not stats:
        return "-"
    units = ((" MiB", 2**20), (" KiB", 2**10))
    held, bound = stats.get("nbytes", 0), stats.get("capacity_bytes", 0)
    hits = stats.get("hits", 0)
    return _held(held, bound, units, hits, hits + stats.get("misses", 0))


def _held(held: int, bound: int, units: tuple[tuple[str, int], ...], hits: int, of: int) -> str:
    """`held`/`bound` in the first of `units` they reach (else the last), then the hit share
    (none while nothing was looked up)."""
    unit, scale = next((u for u in units if max(held, bound) >= u[1]), units[-1])
    size = "/".join(f"{n / scale:.1f}" for n in ((held, bound) if bound else (held,))) + unit
    return f"{size} {100 * hits / of:.0f}% hit" if of else size


def status(info: dict[str, Any]) -> str:
    used, budget = info["memory_used_bytes"] / 2**30, info["memory_budget_bytes"] / 2**30
    total = info["memory_total_bytes"] / 2**30
    models = ", ".join(f"{k} ({v})" for k, v in info["models"].items())
    return (
        f"mlx-gateway {info['version']} (pid {info['pid']}), up {duration(info['uptime_s'])}\n"
        f"memory budget: {used:.1f} of {budget:.1f} GiB in use ({total:.1f} GiB in the machine)\n"
        f"models: {models}"
    )


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def size(n: int | None) -> str:
    """Bytes as people read them: 12.3 MiB, 1.20 GiB; "-" for none."""
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GiB" else f"{n / scale:.1f} {unit}"
    return f"{n} B"
