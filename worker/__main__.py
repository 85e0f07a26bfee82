"""python -m worker --id ID --requests ADDR --outputs ADDR --model JSON
python -m worker --id ID --connect tcp://HOST:PORT --server-key KEY --key-file PATH --model JSON
(the second: a worker on another machine; `gatewayctl worker` runs it)"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import threading
from pathlib import Path

import msgspec

from shared.cluster import ClusterError, check_key, key_pair
from shared.config import ModelConfig
from shared.modelinfo import kind_in
from shared.protocol import PROTOCOL_VERSION, Codec, Hello, WorkerDead
from shared.sharding import HOSTFILE_ENV, TEMP_HOSTFILE_ENV, rank_of
from worker import lifeline
from worker.channels import RemoteLink, WorkerChannels

NO_BACKEND = (
    "MLX has no backend here ({error}): on Linux install mlx-gateway[cpu] or "
    "mlx-gateway[cuda] (./dev picks one)"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker", description=__doc__)
    parser.add_argument("--id", required=True, help="worker identity (DEALER routing id)")
    parser.add_argument("--requests", help="gateway ROUTER address")
    parser.add_argument("--outputs", help="gateway PULL address")
    parser.add_argument("--connect", help="a remote gateway's worker port: tcp://HOST:PORT")
    parser.add_argument("--server-key", help="with --connect: the gateway's public key")
    parser.add_argument(
        "--key-file", help="with --connect: this worker's key pair (made if absent)"
    )
    parser.add_argument("--model", required=True, help="the model's config as JSON")
    parser.add_argument("--no-parent-watch", action="store_true", help="run on after the parent")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    if args.connect is None and (args.requests is None or args.outputs is None):
        parser.error("give --requests and --outputs, or --connect")
    if args.connect is not None and (args.server_key is None or args.key_file is None):
        parser.error("--connect needs --server-key and --key-file")
    model = msgspec.json.decode(args.model, type=ModelConfig)
    handler = logging.StreamHandler(sys.stderr)
    # set by the gateway (gateway/edge/logs.py)
    if os.environ.get("MLX_GATEWAY_LOG_FORMAT") == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s",
                rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
                static_fields={"worker": args.id, "model": model.name},
            )
        )
    else:
        rank = f"/r{rank_of(model.hosts.backend)}" if model.shards > 1 else ""
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s worker[{args.id}{rank}] %(message)s")
        )
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    mpi = model.shards > 1 and model.hosts.backend == "mpi"
    if model.shards > 1 and rank_of(model.hosts.backend) > 0:  # another rank: no sockets
        code = run_follower(args.id, model, not args.no_parent_watch)
        logging.shutdown()
        _leave(mpi and code == 0)
        os._exit(code)
    link = None
    if args.connect is not None:
        try:
            pair = key_pair(Path(args.key_file))
            link = RemoteLink(args.connect, check_key(args.server_key), pair.public, pair.secret)
        except ClusterError as exc:
            logging.getLogger("worker").error("%s", exc)
            return 2
    try:
        from worker.proc import WorkerArgs, WorkerProc
    except ImportError as exc:  # mlx without libmlx.so: say so to the gateway, not only here
        reason = NO_BACKEND.format(error=exc) if "libmlx" in str(exc) else f"import failed: {exc}"
        logging.getLogger("worker").error(reason)
        if link is None:
            _report_dead(args.id, args.requests, args.outputs, model.name, reason)
        logging.shutdown()
        os._exit(1)
    worker = WorkerProc(
        WorkerArgs(
            args.id,
            args.requests or "",
            args.outputs or "",
            model,
            not args.no_parent_watch and link is None,
            link,
        )
    )
    code = worker.run()
    logging.shutdown()
    _leave(mpi and code == 0)
    os._exit(code)  # never wait on a daemon thread stuck in a send to a vanished gateway


def _leave(mpi: bool) -> None:
    """A clean stop over MPI says so to MPI (MPI_Finalize, which os._exit would skip): else
    mpirun takes the first rank to leave for a crash and kills the others, rank 0 with
    its last frames still going out."""
    if mpi:
        from worker.lockstep import finalize_mpi

        finalize_mpi()


def run_follower(worker_id: str, model: ModelConfig, watch_parent: bool) -> int:
    """Rank > 0 of a sharded model: its shard, the same probe as rank 0, then rank 0's
    turns until it stops (or the group breaks: a rank died; or what started it is gone: an
    MPI rank waits on a dead peer for ever)."""
    from worker.faults import Faults
    from worker.loader import resolve_source
    from worker.lockstep import Follower, Lockstep
    from worker.memory import own_memory
    from worker.opening import open_model

    log = logging.getLogger("worker")
    if watch_parent:
        lifeline.watch(threading.Event(), 1.0)
    try:
        own_memory(model.engine)
        try:
            lockstep = Lockstep(model.shards, model.hosts.backend)
        finally:
            if os.environ.get(TEMP_HOSTFILE_ENV) == "1":  # written by the ssh command: read
                with contextlib.suppress(OSError, KeyError):
                    os.unlink(os.environ[HOSTFILE_ENV])
        log.info("rank %d of %d joined", lockstep.rank, model.shards)
        path = resolve_source(model)
        kind = model.kind or kind_in(path)
        faults = Faults.for_model(model.name)
        opened = open_model(model, path, kind, worker_id, faults, _quiet, lockstep.group)
        opened.engine.probe()
        return Follower(lockstep).run(opened.engine, opened.preprocess)
    except Exception:
        log.exception("rank %d failed", rank_of(model.hosts.backend))
        return 1


def _quiet(stage: str, fraction: float) -> None:
    """Progress is rank 0's to report."""


def _report_dead(worker_id: str, requests: str, outputs: str, model: str, reason: str) -> None:
    channels = WorkerChannels.connect(worker_id, requests, outputs)
    codec = Codec()
    channels.outputs.send(codec.encode(Hello(worker_id, PROTOCOL_VERSION, os.getpid(), model)))
    channels.outputs.send(codec.encode(WorkerDead(worker_id, reason)))
    channels.close()  # lingers until the frames are out


if __name__ == "__main__":
    sys.exit(main())
