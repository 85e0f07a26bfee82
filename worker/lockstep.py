"""A model sharded over several worker processes (`shards = N`): one mlx.distributed group
(MLX's ring backend, or MPI), every rank running the same engine in lockstep.

Rank 0 is the worker the gateway knows: it has the sockets, and at each turn of its loop it
shares what it took in (the frames, as received) with the other ranks, which handle the
same frames in the same order and step the same engine; only rank 0's outputs go anywhere.
The engine is deterministic given its inputs (the scheduler reads no clock; unseeded
sampling draws from MLX's global generator, seeded alike on every rank), so every rank
decides the same. What depends on time (a drain's deadline) is decided by rank 0 and shared
as a frame. The other ranks have no socket and no heartbeat: a rank that dies takes the
group down (the ring raises on the others), and the gateway restarts the group as a unit.

The ranks are started by the gateway's supervisor (MLX_RANK, MLX_HOSTFILE: the variables
mlx.launch sets), not by mlx.launch itself, whose launcher process polls its pipes without
sleeping and exits 0 whatever its ranks did; or, over MPI, by the mpirun it starts.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import msgspec
import numpy as np

from shared.protocol import UNDECODABLE, Abort, Add, Codec, Shutdown, ShutdownMode
from shared.sharding import MPI_LIBNAME_ENV

log = logging.getLogger("worker.lockstep")

SEED = 0  # MLX's global generator, alike on every rank
# An idle group: rank 0 shares a turn at least every IDLE_TICK_S, and the other ranks, once
# IDLE_TURNS turns in a row found nothing to do, sleep most of a tick before they join the
# next one. They wait inside MLX's collective, which polls (ring and MPI alike: a core
# each, measured), so without this an idle group kept a core busy per rank for as long as
# it was loaded. The cost: a request arriving at a group idle for a while waits up to
# IDLE_SLEEP_S for the others to wake (requests back to back do not).
IDLE_TICK_S = 0.04
IDLE_SLEEP_S = 0.9 * IDLE_TICK_S
IDLE_TURNS = 5


def finalize_mpi() -> None:
    """MPI_Finalize from the libmpi MLX opened (MLX_MPI_LIBNAME, which the gateway sets):
    MLX has no call for it, and does it only in a destructor at a normal exit."""
    name = os.environ.get(MPI_LIBNAME_ENV)
    if name:
        try:
            ctypes.CDLL(name).MPI_Finalize()
        except OSError as exc:  # not the library MLX opened: mpirun will report an odd exit
            log.warning("MPI_Finalize: %s", exc)


class Turn(msgspec.Struct, array_like=True):
    """What rank 0 took in during one turn of its loop."""

    frames: list[bytes] = []
    stop: bool = False  # drained: every rank leaves its loop


def control_stream(backend: str) -> mx.DeviceType:
    """Where rank 0's turns travel: NCCL reduces only arrays on the GPU; the ring backend
    and MPI, arrays on the CPU (no copy to a device and back for a few bytes)."""
    return mx.gpu if backend == "nccl" else mx.cpu


def control_channel(group: Any, backend: str) -> tuple[Any, Any]:
    """The group and stream the turns travel on. Over NCCL: a communicator of their own
    (the group split) on a GPU stream of their own, so that a turn does not wait behind the
    step the model's stream is running (the host builds step n+1 while the device runs
    step n) and two streams never share one communicator."""
    if control_stream(backend) == mx.gpu:
        return group.split(0), mx.new_stream(mx.gpu)
    return group, mx.cpu


class Lockstep:
    def __init__(self, shards: int, backend: str) -> None:
        if backend == "nccl" and not mx.distributed.is_available("nccl"):
            raise RuntimeError(
                "hosts.backend = 'nccl' needs MLX's CUDA build (pip install "
                "'mlx-gateway[cuda]' on Linux with NVIDIA GPUs); this MLX has no NCCL backend"
            )
        if backend == "nccl" and not mx.cuda.is_available():
            raise RuntimeError(
                f"hosts.backend = 'nccl': this rank sees no GPU (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')!r}): it takes a GPU for each rank"
            )
        group = mx.distributed.init(strict=True, backend=backend)
        if group.size() != shards:
            raise RuntimeError(f"the group has {group.size()} ranks, not shards={shards}")
        self.group = group
        self.control, self.stream = control_channel(group, backend)
        self.rank = group.rank()
        mx.random.seed(SEED)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Turn)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def share(self, turn: Turn | None) -> Turn:
        """Rank 0's turn, on every rank (the others pass None)."""
        data = self._encoder.encode(turn) if turn is not None else b""
        size = mx.distributed.all_sum(
            mx.array([len(data)], dtype=mx.int32), group=self.control, stream=self.stream
        )
        n = int(np.array(size)[0])
        if turn is not None:
            buffer = mx.array(np.frombuffer(data, dtype=np.uint8))
        else:
            buffer = mx.zeros((n,), dtype=mx.uint8)
        shared = mx.distributed.all_sum(buffer, group=self.control, stream=self.stream)
        return self._decoder.decode(bytes(np.array(shared, copy=False)))


class Follower:
    """A rank other than 0: the same model and engine, fed rank 0's turns."""

    def __init__(self, lockstep: Lockstep, rest: Callable[[float], None] = time.sleep) -> None:
        self.lockstep = lockstep
        self.codec = Codec()
        self.draining = False  # as rank 0: after a Shutdown, requests are refused
        self.rest = rest

    def run(self, engine: Any, preprocess: Any) -> int:
        idle = 0  # turns in a row with nothing to do (as on rank 0: the same engine)
        while True:
            turn = self.lockstep.share(None)
            for raw in turn.frames:
                self.handle(engine, preprocess, raw)
            if turn.stop:
                return 0
            idle = 0 if engine.has_work or turn.frames else idle + 1
            if engine.has_work:
                engine.step()
                engine.settle()  # where rank 0 settles: after its step's outputs went out
            elif idle >= IDLE_TURNS:  # rank 0's next turn is a tick away at most
                self.rest(IDLE_SLEEP_S)

    def handle(self, engine: Any, preprocess: Any, raw: bytes) -> None:
        """As rank 0 handles it, its outputs dropped (rank 0's go to the gateway)."""
        try:
            frame = self.codec.to_worker.decode(raw)
        except UNDECODABLE:
            return  # rank 0 dropped it too
        if isinstance(frame, Add):
            if self.draining:
                return  # refused on rank 0 as well
            try:
                prepared = preprocess(frame)
            except Exception:  # refused on rank 0 as well (PreprocessError, or a bug there)
                return
            try:
                engine.add(prepared)
            except Exception:  # refused by rank 0's engine as well
                log.debug("request %s refused by the engine", frame.request_id)
        elif isinstance(frame, Abort):
            engine.abort(frame.request_ids)
        elif isinstance(frame, Shutdown):
            self.draining = True
            if frame.mode == ShutdownMode.ABORT:
                engine.abort(engine.request_ids())
