"""gatewayctl: serve, and a thin client of the admin API on the unix socket."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
from rich.live import Live

from gateway.ctl import catalog, hub, term
from gateway.ctl import chat as chat_cli
from gateway.ctl import keys as keys_cli
from gateway.ctl import ps as ps_view
from gateway.ctl import service as service_cli
from gateway.ctl import workers as workers_cli
from gateway.ctl.admin_client import AdminError
from gateway.ctl.admin_client import call as _call
from shared.config import Config, ConfigError, ModelConfig, load_config
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
    workers_cli.add_parsers(sub)
    load = sub.add_parser("load", help="start a model's worker (and wait until it is ready)")
    load.add_argument("model")
    load.add_argument("--wait", dest="wait", action="store_true", default=True, help="default")
    load.add_argument("--no-wait", dest="wait", action="store_false", help="return at once")
    load.add_argument("--source", help="add a model that is not configured: path or hub id")
    load.add_argument("--alias", action="append", default=[], help="with --source")
    load.add_argument("--ttl", help="with --source: idle time before unloading (30m, -1)")
    load.add_argument("--timeout", type=float, default=900.0, help="give up waiting (s)")
    load.add_argument("--save", action="store_true", help="with --source: keep it in the config")
    unload = sub.add_parser("unload", help="drain and stop a model's worker")
    unload.add_argument("model")
    unload.add_argument("--force", action="store_true", help="abort in-flight requests at once")
    unload.add_argument("--timeout", type=float, default=None, help="drain timeout (s)")
    reload = sub.add_parser("reload", help="start a new worker, switch to it, drain the old")
    reload.add_argument("model")
    ps_cmd = sub.add_parser("ps", help="models, workers and their load")
    ps_cmd.add_argument("--json", action="store_true")
    logs = sub.add_parser("logs", help="a model's worker log")
    logs.add_argument("model")
    logs.add_argument("-f", "--follow", action="store_true")
    status = sub.add_parser("status", help="the gateway: version, uptime, memory budget")
    status.add_argument("--json", action="store_true")
    pull = sub.add_parser("pull", help="download a model into the hub cache (or check a folder)")
    pull.add_argument("model", help="a configured model, a hub id or a local folder")
    pull.add_argument("--revision", help="a hub id's branch, tag or commit")
    ls = sub.add_parser("ls", help="the catalog: kind, size on disk, state")
    ls.add_argument("--json", action="store_true")
    rm = sub.add_parser("rm", help="delete a model's weights from the hub cache")
    rm.add_argument("model", help="a configured model or a hub id")
    rm.add_argument("-y", "--yes", action="store_true", help="do not ask")
    chat = sub.add_parser("chat", help="chat with a model in the terminal")
    chat.add_argument("model")
    chat.add_argument("--system", help="a system message")
    chat.add_argument("--url", help="the gateway's address (default: from the config)")
    chat.add_argument("--max-tokens", type=int, help="each reply's length at most")
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
    if args.command == "workers":
        return workers_cli.run_workers(args, config)
    if args.command == "worker":
        return workers_cli.run_worker(args, config)
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
    if args.command in ("pull", "ls", "rm", "chat"):
        return _catalog(args, config, admin)
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
            if args.json:
                print(json.dumps(rows, indent=2))
            else:
                if ps_view.has_replicas(rows):
                    term.show(ps_view.table(rows))
                    term.show(ps_view.replicas(rows), ps_view.notes(rows))
                else:
                    term.show(ps_view.table(rows), ps_view.notes(rows))
        elif args.command == "status":
            info = _call(admin, "GET", "/status")
            print(json.dumps(info, indent=2) if args.json else ps_view.status(info))
        elif args.command == "logs":
            return _logs(admin, args.model, args.follow)
    except (AdminError, ConfigError) as exc:
        print(f"gatewayctl: {exc}", file=sys.stderr)
        return 1
    return 0


def _catalog(args: argparse.Namespace, config: Config, admin: Path) -> int:
    if args.command == "ls":
        return catalog.ls(config, admin, args.json)
    if args.command == "rm":
        return catalog.rm(config, admin, args.model, args.yes)
    if args.command == "chat":
        return chat_cli.run(config, args.model, args.system, args.url, args.max_tokens)
    known = {m.name: m for m in config.models}
    model = known.get(args.model) or ModelConfig(name=args.model, source=args.model)
    if args.revision:
        model = msgspec.structs.replace(model, revision=args.revision)
    try:
        print(hub.pull(model))
    except hub.HubError as exc:
        print(f"gatewayctl pull: {exc}", file=sys.stderr)
        return 1
    return 0


def _load(admin: Path, args: argparse.Namespace) -> int:
    body: dict[str, object] = {"model": args.model, "wait": False}
    saving = catalog.config_path(args.config) if args.save else None
    if args.save and args.source is None:
        raise ConfigError("--save keeps a model added with --source (others are configured)")
    if args.save and saving is None:
        raise ConfigError("--save needs a config file: --config FILE or $MLX_GATEWAY_CONFIG")
    if args.source:
        local = Path(args.source).expanduser()
        source = str(local.resolve()) if local.exists() else args.source
        body.update(source=source, aliases=args.alias)
        if args.ttl is not None:
            body["ttl"] = args.ttl
    result = _call(admin, "POST", "/load", body)
    name = result["model"]
    if not args.wait:
        print(f"{name}: {result['state']}")
    elif (row := _wait_loaded(admin, name, args.timeout))["state"] != "ready":
        reason = row.get("error") or row.get("last_error") or f"still {row.get('state')}"
        print(f"gatewayctl: {name}: {reason}", file=sys.stderr)
        return 1
    else:
        print(f"{name}: ready (pid {row['pid']})")
    if saving is not None:
        ttl = args.ttl
        with contextlib.suppress(TypeError, ValueError):
            ttl = float(ttl)
        model = ModelConfig(name=name, source=str(body["source"]), aliases=args.alias, ttl=ttl)
        catalog.save(saving, model)
        print(f"{name}: saved in {saving}")
    return 0


def _wait_loaded(admin: Path, name: str, timeout: float) -> dict[str, Any]:
    """Poll ps until the model is no longer loading, with a live progress line on a terminal."""
    err = term.console(stderr=True)
    started = time.monotonic()
    row: dict[str, Any] = {}
    with Live(console=err, transient=True, auto_refresh=False) as live:
        while time.monotonic() - started < timeout:
            row = next(r for r in _call(admin, "GET", "/ps") if r["model"] == name)
            if row["state"] != "loading":
                break
            if err.is_terminal:
                live.update(_progress_line(name, row, time.monotonic() - started), refresh=True)
            time.sleep(0.2)
    return row


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


if __name__ == "__main__":
    sys.exit(main())
