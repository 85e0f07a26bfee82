"""gatewayctl: serve, and a thin client of the admin API on the unix socket."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import httpx
import msgspec

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
    load = sub.add_parser("load", help="start a model's worker")
    load.add_argument("model")
    load.add_argument("--no-wait", action="store_true", help="return once spawned")
    unload = sub.add_parser("unload", help="drain and stop a model's worker")
    unload.add_argument("model")
    unload.add_argument("--force", action="store_true", help="abort in-flight requests at once")
    unload.add_argument("--timeout", type=float, default=30.0, help="drain timeout (s)")
    ps = sub.add_parser("ps", help="models, workers and their load")
    ps.add_argument("--json", action="store_true")
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
        }.items()
        if v is not None
    }
    if overrides:
        server = msgspec.structs.replace(config.server, **overrides)
        config = msgspec.structs.replace(config, server=server)

    if args.command == "serve":
        from gateway.server import serve as run_server

        run_server(config)
        return 0
    admin = RunDir(config.server.run_dir).admin_socket
    try:
        if args.command == "load":
            result = _call(admin, "POST", "/load", {"model": args.model, "wait": not args.no_wait})
            print(f"{result['model']}: {result['state']} (pid {result['pid']})")
        elif args.command == "unload":
            body = {"model": args.model, "force": args.force, "timeout_s": args.timeout}
            result = _call(admin, "POST", "/unload", body, timeout=args.timeout + 30)
            print(f"{args.model}: {'unloaded' if result['unloaded'] else 'was not loaded'}")
        elif args.command == "ps":
            rows = _call(admin, "GET", "/ps")
            print(json.dumps(rows, indent=2) if args.json else _table(rows))
    except AdminError as exc:
        print(f"gatewayctl: {exc}", file=sys.stderr)
        return 1
    return 0


class AdminError(Exception):
    pass


def _call(socket: Path, method: str, path: str, body: object = None, timeout: float = 600) -> Any:
    if not socket.exists():
        raise AdminError(f"no gateway is running (no admin socket at {socket})")
    transport = httpx.HTTPTransport(uds=str(socket))
    with httpx.Client(transport=transport, base_url="http://gateway", timeout=timeout) as client:
        try:
            response = client.request(method, path, json=body)
        except httpx.TransportError as exc:
            raise AdminError(f"cannot reach the gateway at {socket}: {exc}") from exc
    data = response.json()
    if response.status_code >= 400:
        raise AdminError(data.get("error", response.text))
    return data


def _table(rows: list[dict[str, Any]]) -> str:
    header = ("MODEL", "STATE", "PID", "MEMORY", "RUNNING", "WAITING", "UPTIME")
    lines = [header]
    for r in rows:
        rss = r.get("rss_bytes")
        uptime = r.get("uptime_s")
        lines.append(
            (
                r["model"],
                r["state"],
                str(r["pid"] or "-"),
                f"{rss / 2**20:.0f} MiB" if rss else "-",
                str(r["running"]),
                str(r["waiting"]),
                f"{uptime:.0f}s" if uptime is not None else "-",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) for line in lines]
    errors = [f"{r['model']}: {r['error']}" for r in rows if r.get("error")]
    return "\n".join(out + errors)


if __name__ == "__main__":
    sys.exit(main())
