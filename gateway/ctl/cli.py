"""gatewayctl: serve, and a thin client of the admin API on the unix socket."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec

from gateway.ctl import keys as keys_cli
from gateway.ctl import service as service_cli
from shared.config import ConfigError, load_config
from shared.paths import RunDir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gatewayctl", description="mlx-gateway control")
    parser.add_argument("--config", help="TOML config file (default: $MLX_GATEWAY_CONFIG)")
    parser.add_argument("--run-dir", help="run directory (sockets, logs)")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway in the foreground")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--blas", help="auto | off | path to a BLAS library to preload")
    serve.add_argument(
        "--insecure-no-auth",
        action="store_true",
        default=None,
        help="serve a non-loopback address even with no API key (anyone may use it)",
    )
    keys_cli.add_parser(sub)
    load = sub.add_parser("load", help="start a model's worker (and wait until it is ready)")
    load.add_argument("model")
    load.add_argument("--wait", dest="wait", action="store_true", default=True, help="default")
    load.add_argument("--no-wait", dest="wait", action="store_false", help="return at once")
    load.add_argument("--source", help="add a model that is not configured: path or hub id")
    load.add_argument("--alias", action="append", default=[], help="with --source")
    load.add_argument("--ttl", help="with --source: idle time before unloading (30m, -1)")
    load.add_argument("--timeout", type=float, default=900.0, help="give up waiting (s)")
    unload = sub.add_parser("unload", help="drain and stop a model's worker")
    unload.add_argument("model")
    unload.add_argument("--force", action="store_true", help="abort in-flight requests at once")
    unload.add_argument("--timeout", type=float, default=None, help="drain timeout (s)")
    reload = sub.add_parser("reload", help="start a new worker, switch to it, drain the old")
    reload.add_argument("model")
    ps = sub.add_parser("ps", help="models, workers and their load")
    ps.add_argument("--json", action="store_true")
    logs = sub.add_parser("logs", help="a model's worker log")
    logs.add_argument("model")
    logs.add_argument("-f", "--follow", action="store_true")
    status = sub.add_parser("status", help="the gateway: version, uptime, memory budget")
    status.add_argument("--json", action="store_true")
    service = sub.add_parser("service", help="run the gateway under launchd or systemd")
    service_cli.add_arguments(service)
    args = parser.parse_args(argv)

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"gatewayctl: {exc}", file=sys.stderr)
        return 2
    overrides = {
        k: v
        for k, v in {
            "run_dir": args.run_dir,
            "host": getattr(args, "host", None),
            "port": getattr(args, "port", None),
            "blas": getattr(args, "blas", None),
            "insecure_no_auth": getattr(args, "insecure_no_auth", None),
        }.items()
        if v is not None
    }
    if overrides:
        server = msgspec.structs.replace(config.server, **overrides)
        config = msgspec.structs.replace(config, server=server)

    if args.command == "keys":
        return keys_cli.run(args, config)
    if args.command == "serve":
        refusal = keys_cli.check_bind(config)
        if refusal is not None:
            print(f"gatewayctl: {refusal}", file=sys.stderr)
            return 2
        from gateway.ctl.server import serve as run_server

        run_server(config)
        return 0
    if args.command == "service":
        return service_cli.main(args, config)
    admin = RunDir(config.server.run_dir).admin_socket
    try:
        if args.command == "load":
            return _load(admin, args)
        if args.command == "unload":
            body = {"model": args.model, "force": args.force, "timeout_s": args.timeout}
            wait = (args.timeout or 600.0) + 30
            result = _call(admin, "POST", "/unload", body, timeout=wait)
            print(f"{args.model}: {'unloaded' if result['unloaded'] else 'was not loaded'}")
        elif args.command == "reload":
            result = _call(admin, "POST", "/reload", {"model": args.model})
            print(f"{result['model']}: reloaded (pid {result['pid']})")
        elif args.command == "ps":
            rows = _call(admin, "GET", "/ps")
            print(json.dumps(rows, indent=2) if args.json else _table(rows))
        elif args.command == "status":
            info = _call(admin, "GET", "/status")
            print(json.dumps(info, indent=2) if args.json else _status(info))
        elif args.command == "logs":
            return _logs(admin, args.model, args.follow)
    except AdminError as exc:
        print(f"gatewayctl: {exc}", file=sys.stderr)
        return 1
    return 0


class AdminError(Exception):
    pass


def _load(admin: Path, args: argparse.Namespace) -> int:
    body: dict[str, object] = {"model": args.model, "wait": False}
    if args.source:
        body.update(source=args.source, aliases=args.alias)
        if args.ttl is not None:
            body["ttl"] = args.ttl
    result = _call(admin, "POST", "/load", body)
    name = result["model"]
    if not args.wait:
        print(f"{name}: {result['state']}")
        return 0
    tty = sys.stderr.isatty()
    started = time.monotonic()
    row: dict[str, Any] = {}
    while time.monotonic() - started < args.timeout:
        row = next(r for r in _call(admin, "GET", "/ps") if r["model"] == name)
        if row["state"] != "loading":
            break
        if tty:
            print(
                f"\r\033[K{_progress_line(name, row, time.monotonic() - started)}",
                end="",
                file=sys.stderr,
                flush=True,
            )
        time.sleep(0.2)
    if tty:
        print("\r\033[K", end="", file=sys.stderr, flush=True)
    if row.get("state") == "ready":
        print(f"{name}: ready (pid {row['pid']})")
        return 0
    reason = row.get("error") or row.get("last_error") or f"still {row.get('state')}"
    print(f"gatewayctl: {name}: {reason}", file=sys.stderr)
    return 1


def _progress_line(name: str, row: dict[str, Any], elapsed: float) -> str:
    """loading NAME  downloading [#####.....]  52%  12.3s  1.20 GiB"""
    stage = row.get("stage") or "starting"
    fraction = row.get("progress")
    bar = ""
    if isinstance(fraction, int | float) and fraction >= 0:
        filled = int(fraction * 20)
        bar = f" [{'#' * filled}{'.' * (20 - filled)}] {fraction * 100:3.0f}%"
    memory = row.get("memory_bytes") or row.get("rss_bytes")
    held = f"  {memory / 2**30:.2f} GiB" if memory else ""
    return f"loading {name}  {stage}{bar}  {elapsed:.1f}s{held}"


def _logs(admin: Path, model: str, follow: bool) -> int:
    result = _call(admin, "GET", "/logs", params={"model": model})
    sys.stdout.write(result["text"])
    offset = result["offset"]
    while follow:
        time.sleep(0.5)
        result = _call(admin, "GET", "/logs", params={"model": model, "offset": offset})
        if result["offset"] < offset:  # the log was replaced
            offset = 0
            continue
        sys.stdout.write(result["text"])
        sys.stdout.flush()
        offset = result["offset"]
    return 0


def _status(info: dict[str, Any]) -> str:
    used, budget = info["memory_used_bytes"] / 2**30, info["memory_budget_bytes"] / 2**30
    total = info["memory_total_bytes"] / 2**30
    models = ", ".join(f"{k} ({v})" for k, v in info["models"].items())
    return (
        f"mlx-gateway {info['version']} (pid {info['pid']}), up {_duration(info['uptime_s'])}\n"
        f"memory budget: {used:.1f} of {budget:.1f} GiB in use ({total:.1f} GiB in the machine)\n"
        f"models: {models}"
    )


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _call(
    socket: Path,
    method: str,
    path: str,
    body: object = None,
    timeout: float = 600,
    params: dict[str, Any] | None = None,
) -> Any:
    if not socket.exists():
        raise AdminError(f"no gateway is running (no admin socket at {socket})")
    transport = httpx.HTTPTransport(uds=str(socket))
    with httpx.Client(transport=transport, base_url="http://gateway", timeout=timeout) as client:
        try:
            response = client.request(method, path, json=body, params=params)
        except httpx.TransportError as exc:
            raise AdminError(f"cannot reach the gateway at {socket}: {exc}") from exc
    data = response.json()
    if response.status_code >= 400:
        raise AdminError(data.get("error", response.text))
    return data


def _prefix_cache(stats: dict[str, int] | None) -> str:
    """1.2/2.0 GiB 63% hit: held of its bound, and the share of lookups that reused a prefix."""
    if not stats:
        return "-"
    held, bound = stats.get("nbytes", 0), stats.get("capacity_bytes", 0)
    unit, scale = ("GiB", 2**30) if max(held, bound) >= 2**30 else ("MiB", 2**20)
    size = "/".join(f"{n / scale:.1f}" for n in ((held, bound) if bound else (held,)))
    size += f" {unit}"
    lookups = stats.get("lookups", 0)
    if not lookups:
        return size
    return f"{size} {100 * stats.get('hits', 0) / lookups:.0f}% hit"


def _table(rows: list[dict[str, Any]]) -> str:
    header = (
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
    )
    lines = [header]
    for r in rows:
        memory = r.get("memory_bytes") or r.get("rss_bytes")
        ttl_left = r.get("ttl_left_s")
        if r.get("ttl_s") is None:
            ttl = "never"  # no TTL: stays loaded
        else:
            ttl = _duration(ttl_left) if ttl_left is not None else "-"  # busy or unloaded
        lines.append(
            (
                r["model"],
                str(r.get("kind", "-")),
                r["state"],
                str(r["pid"] or "-"),
                f"{memory / 2**20:.0f} MiB" if memory else "-",
                str(r["running"]),
                str(r["waiting"]),
                str(r.get("served", 0)),
                str(r.get("restarts", 0)),
                _duration(r.get("uptime_s")),
                ttl,
                _prefix_cache(r.get("prefix_cache")),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = [
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    ]
    for r in rows:
        if r.get("error"):
            out.append(f"{r['model']}: {r['error']}")
            if r.get("exit_code") is not None:
                out.append(f"  exit status {r['exit_code']}; `gatewayctl logs {r['model']}`")
        elif r.get("next_attempt_s") is not None:
            out.append(
                f"{r['model']}: backing off: {r.get('last_error')}; next attempt in "
                f"{_duration(r['next_attempt_s'])}"
            )
            if r.get("exit_code") is not None:
                out.append(f"  exit status {r['exit_code']}; `gatewayctl logs {r['model']}`")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
