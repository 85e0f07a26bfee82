"""Workers on other machines, from the command line.

On the gateway's machine, `gatewayctl workers key | add | remove | list` manage who may dial
in (the running gateway sees a change within a second; a removed worker is dropped). On a
worker's machine, `gatewayctl worker --gateway HOST:PORT --gateway-key KEY --model NAME`
runs a worker that dials in, and keeps it running: it starts it again after a crash (after a
backoff), after a refusal of its key (a key allowed meanwhile then gets in) and, a minute
later, after a refusal by the gateway (other weights than the model's, say).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import logging
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

import msgspec

from gateway.workers.device import detect_device
from gateway.workers.processes import worker_argv
from shared.addresses import tcp_endpoint
from shared.blas import worker_env
from shared.cluster import (
    ALLOWED_FILE,
    GATEWAY_KEY,
    WORKER_KEY,
    AllowedWorkers,
    ClusterError,
    check_key,
    cluster_dir,
    key_pair,
)
from shared.config import Config, ConfigError, ModelConfig, split_address

log = logging.getLogger("gatewayctl.worker")

RETRY_REFUSED_S = 10.0  # a refused key: dial again this much later
RETRY_REJECTED_S = 60.0  # refused by the gateway (other weights, ...): again this much later
BACKOFF_S, BACKOFF_MAX_S = 1.0, 60.0  # after a crash, doubling while it keeps crashing
STABLE_S = 60.0  # a run this long resets the backoff
EXIT_REFUSED_KEY, EXIT_REFUSED = 77, 78  # worker/link.py


def add_parsers(sub: argparse._SubParsersAction) -> None:
    workers = sub.add_parser("workers", help="workers on other machines: who may dial in")
    wsub = workers.add_subparsers(dest="workers_command", required=True)
    wsub.add_parser("key", help="the gateway's public key (workers need it)")
    add = wsub.add_parser("add", help="allow a worker's public key")
    add.add_argument("name", help="a name for it (its machine, say)")
    add.add_argument("public_key", help="what `gatewayctl worker --show-key` printed there")
    remove = wsub.add_parser("remove", help="refuse a worker from now on (drops it if connected)")
    remove.add_argument("worker", help="its name or public key")
    listing = wsub.add_parser("list", help="the workers allowed to dial in")
    listing.add_argument("--json", action="store_true")

    worker = sub.add_parser("worker", help="run a worker here that dials in to a gateway")
    worker.add_argument("--gateway", help="the gateway's worker port: HOST:PORT")
    worker.add_argument("--gateway-key", help="its public key (`gatewayctl workers key` there)")
    worker.add_argument("--model", help="the model's name on the gateway")
    worker.add_argument("--source", help="its weights here: a folder or a hub id")
    worker.add_argument("--id", help="this worker's id (default: MODEL@HOSTNAME-KEYHASH)")
    worker.add_argument("--key-file", help="this worker's key pair (made if absent)")
    worker.add_argument("--show-key", action="store_true", help="print this worker's key")
    worker.add_argument("--once", action="store_true", help="do not start it again after exit")


def run_workers(args: argparse.Namespace, config: Config) -> int:
    folder = cluster_dir(config.server.cluster_dir)
    allowed = AllowedWorkers(folder / ALLOWED_FILE)
    try:
        if args.workers_command == "key":
            print(key_pair(folder / GATEWAY_KEY).public)
            if not config.server.workers_listen:
                print(
                    "note: server.workers_listen is not set: the gateway opens no worker port",
                    file=sys.stderr,
                )
            return 0
        if args.workers_command == "add":
            record = allowed.add(args.name, args.public_key)
            print(f"worker {record.name!r} may dial in ({allowed.path})")
            return 0
        if args.workers_command == "remove":
            record = allowed.remove(args.worker)
            print(f"worker {record.name!r} removed: it is refused from now on")
            return 0
        rows = [
            {
                "name": w.name,
                "public_key": w.public_key,
                "added_at": dt.datetime.fromtimestamp(w.added_at)
                .astimezone()
                .isoformat("T", "seconds"),
            }
            for w in allowed.all()
        ]
        if args.json:
            print(json.dumps(rows))
        elif not rows:
            print("no workers allowed (add one with `gatewayctl workers add NAME KEY`)")
        else:
            width = max(len(r["name"]) for r in rows)
            print(f"{'NAME'.ljust(width)}  {'PUBLIC KEY'.ljust(40)}  ADDED")
            for r in rows:
                print(f"{r['name'].ljust(width)}  {r['public_key']}  {r['added_at']}")
        return 0
    except ClusterError as exc:
        print(f"gatewayctl workers: {exc}", file=sys.stderr)
        return 2


def default_id(model: str, public_key: str) -> str:
    """MODEL@HOSTNAME-xxxxxx: the same on every run of this machine (it takes its row back
    when it dials in again), another on another machine even with the same host name (the
    suffix comes from this machine's worker key)."""
    digest = hashlib.sha256(public_key.encode()).hexdigest()[:6]
    return f"{model}@{socket.gethostname()}-{digest}"


def worker_command(args: argparse.Namespace, config: Config, public_key: str) -> list[str]:
    """The worker's command line, from the arguments and this machine's config."""
    if not args.gateway or not args.gateway_key or not args.model:
        raise ConfigError("gatewayctl worker needs --gateway, --gateway-key and --model")
    host, port = split_address(args.gateway, "--gateway")
    server_key = check_key(args.gateway_key)
    known = {m.name: m for m in config.models}
    model = known.get(args.model)
    if args.source is not None:
        model = msgspec.structs.replace(model, source=args.source) if model else None
        model = model or ModelConfig(name=args.model, source=args.source)
    if model is None:
        raise ConfigError(
            f"model {args.model!r} is not in this machine's config: give --source (its "
            "weights here)"
        )
    if model.shards > 1:
        raise ConfigError(
            f"model {model.name!r} has shards = {model.shards}: a worker on another machine "
            "runs one process (serve a sharded model from the gateway's machine)"
        )
    model = msgspec.structs.replace(model, placement="local", preload=True)
    worker_id = args.id or default_id(model.name, public_key)
    key_file = (
        Path(args.key_file)
        if args.key_file
        else cluster_dir(config.server.cluster_dir) / WORKER_KEY
    )
    return worker_argv(
        worker_id,
        msgspec.json.encode(model).decode(),
        "--connect",
        tcp_endpoint(host, port),
        "--server-key",
        server_key,
        "--key-file",
        str(key_file),
        "--log-level",
        config.server.log_level,
    )


def run_worker(args: argparse.Namespace, config: Config) -> int:
    folder = cluster_dir(config.server.cluster_dir)
    try:
        key_file = Path(args.key_file) if args.key_file else folder / WORKER_KEY
        pair = key_pair(key_file)
        if args.show_key:
            print(pair.public)
            return 0
        argv = worker_command(args, config, pair.public)
    except (ClusterError, ConfigError) as exc:
        print(f"gatewayctl worker: {exc}", file=sys.stderr)
        return 2
    print(
        f"worker key {pair.public}: the gateway must allow it "
        f"(there: gatewayctl workers add NAME {pair.public})",
        file=sys.stderr,
    )
    env = worker_env(config.server.blas, config.server.blas_threads, device=detect_device().kind)
    return Keeper(argv, env, once=args.once).run()


class Keeper:
    """Runs the worker, and again after it exits, until told to stop."""

    def __init__(self, argv: list[str], env: dict[str, str], once: bool = False) -> None:
        self.argv = argv
        self.env = env
        self.once = once
        self.child: subprocess.Popen[bytes] | None = None
        self.stopping = False

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        backoff = BACKOFF_S
        while True:
            started = time.monotonic()
            self.child = subprocess.Popen(self.argv, env=self.env)
            code = self.child.wait()
            if self.stopping or self.once:
                return 0 if self.stopping else code
            if code == EXIT_REFUSED:  # the gateway's side may change (weights, its config)
                wait = RETRY_REJECTED_S
                print(
                    f"gatewayctl worker: the gateway refused this worker (see above); "
                    f"again in {wait:g}s",
                    file=sys.stderr,
                )
            elif code == EXIT_REFUSED_KEY:
                wait = RETRY_REFUSED_S
            else:
                if time.monotonic() - started >= STABLE_S:
                    backoff = BACKOFF_S
                wait, backoff = backoff, min(backoff * 2, BACKOFF_MAX_S)
                print(
                    f"gatewayctl worker: the worker exited ({code}); again in {wait:g}s",
                    file=sys.stderr,
                )
            deadline = time.monotonic() + wait
            while not self.stopping and time.monotonic() < deadline:
                time.sleep(0.1)
            if self.stopping:
                return 0
