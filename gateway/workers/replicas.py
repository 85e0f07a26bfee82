"""Workers on other machines, as replicas of their models.

A worker dials in through the remote door (gateway/workers/remote.py) and says Hello: if its
key is allowed, its protocol is the gateway's and its model is configured here, it joins
that model's slot as a replica (state loading); its Ready makes it serve once its weights
are the same as its model's other replicas' (`Ready.identity`: the gateway's own copy of the
model when it has one, else the first replica's). Every frame after that must come from the
key it joined with.

The gateway cannot restart such a worker. One that goes silent for server.heartbeat_timeout_s,
whose engine stalls for wedge_timeout_s, whose connection closes, or whose key is removed is
`lost`: the requests it had not started go to another replica (the local worker loaded for
them when the model has one), those it had started end with one clear `worker_died` error,
and it stays listed as lost until it dials in again. A worker the gateway does not know (it
restarted, or took the worker for lost) is asked to Rejoin: drop what it runs and say Hello
and Ready again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

from gateway.workers.catalog import Catalog
from gateway.workers.control import ControlCalls
from gateway.workers.recovery import Recovery
from gateway.workers.remote import RemoteDoor
from gateway.workers.routing import Router
from gateway.workers.slots import RemotePeer, Slot, WorkerHandle
from shared.modelinfo import model_identity
from shared.protocol import (
    PROTOCOL_VERSION,
    Abort,
    FromWorker,
    Hello,
    Ready,
    Refuse,
    Rejoin,
    StepOutputs,
    WorkerDead,
)
from shared.types import ErrorCode

log = logging.getLogger("gateway.workers.replicas")

REJOIN_EVERY_S = 2.0  # a worker the gateway does not know is asked to rejoin this often
KEY_CHECK_S = 1.0
RECHECK_S = 0.5  # after a disconnect, reachability is checked again this much later
LOST_KEPT = 8  # lost replicas listed per model (the oldest dropped past this)
LOADING_PER_KEY = 8  # workers of one key joined and not Ready yet, at most


class Replicas:
    def __init__(
        self,
        door: RemoteDoor,
        catalog: Catalog,
        calls: ControlCalls,
        recovery: Recovery,
        router: Router,
        load_local: Callable[[Slot], object],
        released: Callable[[Slot | None], None],
        is_local: Callable[[str], bool] = lambda worker_id: False,
        load_timeout_s: float = 300.0,
    ) -> None:
        self.door = door
        self.catalog = catalog
        self.calls = calls
        self.recovery = recovery
        self.router = router
        self.load_local = load_local
        self.released = released
        self.is_local = is_local
        self.load_timeout_s = load_timeout_s
        self.closing = False  # the gateway shuts down
        self._recheck: asyncio.TimerHandle | None = None
        self._again = False
        self.by_id: dict[str, WorkerHandle] = {}
        self._rejoin_sent: dict[str, float] = {}
        self._warned: dict[str, float] = {}

    def get(self, worker_id: str) -> WorkerHandle | None:
        handle = self.by_id.get(worker_id)
        return handle if handle is not None and not handle.lost else None

    def live(self) -> list[WorkerHandle]:
        return [h for h in self.by_id.values() if not h.lost]

    # ---- frames -----------------------------------------------------------------------

    def admit(self, frame: FromWorker, key: str, peer: str, sender: bytes) -> WorkerHandle | None:
        """The replica this frame is for, or None when it was dealt with here (a Hello, a
        worker to rejoin, a frame from the wrong key). `sender`: the routing id of the
        connection it came on."""
        handle = self.get(frame.worker_id)
        if isinstance(frame, Hello):
            # said on its requests socket, whose routing id is its worker id: the id is this
            # connection's (no other can take it while it is open), and so this key's
            if sender != frame.worker_id.encode():
                self._warn("hello", f"a Hello for {frame.worker_id!r} not from its requests socket")
                return None
            self.join(frame, key, peer, handle)
            return None
        if handle is None:
            if not isinstance(frame, WorkerDead):  # a lost worker's last word needs no answer
                self.rejoin(frame.worker_id)
            return None
        remote = handle.remote
        assert remote is not None
        if remote.public_key != key:
            self._warn("key", f"a frame for worker {frame.worker_id!r} from another key ({key})")
            return None
        if isinstance(frame, StepOutputs) and frame.session != remote.session:
            return None  # of requests it dropped when it joined again: nobody waits for them
        if isinstance(frame, StepOutputs) and frame.seq:
            stream = 1 if frame.step < 0 else 0  # its refusals, or its engine's steps
            if frame.seq != remote.seqs[stream] + 1:
                # a connection dropped with frames on it: what it runs is not whole anymore
                self.lose(handle, "step outputs from it were lost on the way")
                self.rejoin(frame.worker_id)
                return None
            remote.seqs[stream] = frame.seq
        return handle

    def _warn(self, kind: str, message: str) -> None:
        """Logged once a minute per kind: a peer cannot flood the log."""
        now = time.monotonic()
        if now - self._warned.get(kind, -60.0) >= 60.0:
            self._warned[kind] = now
            log.warning("%.200s, dropped (such frames are logged once a minute)", message)

    def join(self, frame: Hello, key: str, peer: str, current: WorkerHandle | None) -> None:
        worker_id = frame.worker_id
        record = self.door.allowed.lookup(key)
        if record is None:
            self.refuse(worker_id, "its key is not allowed (gatewayctl workers add)")
            return
        if frame.protocol_version != PROTOCOL_VERSION:
            self.refuse(
                worker_id,
                f"protocol version {frame.protocol_version} != the gateway's {PROTOCOL_VERSION}",
            )
            return
        slot = self.catalog.slots.get(frame.model)
        if slot is None:
            self.refuse(worker_id, f"model {frame.model!r} is not configured on this gateway")
            return
        if self.is_local(worker_id):
            self.refuse(worker_id, f"worker id {worker_id!r} is one of the gateway's own")
            return
        loading = [
            h for h in self.live() if not h.is_ready and h.remote and h.remote.public_key == key
        ]
        if len(loading) >= LOADING_PER_KEY:
            self.refuse(worker_id, f"{len(loading)} workers of its key are loading already")
            return
        if current is not None:  # its connection is gone: this one holds the id now
            self.lose(current, "it dialed in again (its previous connection ended)", True)
        for old in [h for h in slot.remotes if h.worker_id == worker_id]:
            slot.remotes.remove(old)  # lost: the new run takes its place in the list
        lost = [h for h in slot.remotes if h.lost]
        for old in lost[: max(0, len(lost) - LOST_KEPT + 1)]:
            slot.remotes.remove(old)
            if self.by_id.get(old.worker_id) is old:
                del self.by_id[old.worker_id]
        handle = WorkerHandle(
            slot.config,
            worker_id,
            None,
            remote=RemotePeer(record.name, key, peer, frame.pid, frame.session),
        )
        slot.remotes.append(handle)
        self.by_id[worker_id] = handle
        self.door.routes.add(worker_id)
        self._rejoin_sent.pop(worker_id, None)
        log.info(
            "model %s: worker %.200r joined from %s (key %r, pid %d)",
            slot.name,
            worker_id,
            peer,
            record.name,
            frame.pid,
        )

    def ready(self, handle: WorkerHandle, frame: Ready) -> bool:
        """Its Ready: False (and refused) when it serves other weights than its model's."""
        slot = self.catalog.slots.get(handle.config.name)
        if slot is None:
            return False
        expected = identity(slot)
        if expected and frame.identity != expected:
            reason = (
                f"it serves other weights ({frame.identity or 'unknown'}) than model "
                f"{slot.name!r} ({expected})"
            )
            self.refuse(handle.worker_id, reason)
            self._drop(slot, handle)
            if slot.replay and not slot.ready_remotes():  # what waited for it (lose, back)
                self._no_replica(slot, f"worker {handle.worker_id} was refused: {reason}")
            return False
        if not expected and frame.identity:
            slot.identity = frame.identity
        return True

    def serve_waiting(self, slot: Slot, handle: WorkerHandle) -> None:
        """A replica became ready: the requests waiting for a worker go to it (but those to
        be tried alone after a crash, which wait for the model's own worker)."""
        waiting = [s for s in slot.replay if not s.alone]
        if not waiting:
            return
        slot.replay = [s for s in slot.replay if s.alone]
        for stream in waiting:
            self.recovery.send(slot, handle, stream)
        log.info(
            "model %s: %d waiting request(s) sent to %s", slot.name, len(waiting), handle.worker_id
        )

    def local_exited(self, slot: Slot) -> None:
        """The model's own worker exited (recovery has dealt with it): while another
        machine serves the model, the requests waiting for the next local worker go there."""
        ready = slot.ready_remotes()
        if ready and slot.replay:
            self.serve_waiting(slot, self.router.choose(ready, None))

    # ---- losing one -------------------------------------------------------------------

    def lose(self, handle: WorkerHandle, reason: str, back: bool = False) -> None:
        """`back`: it is dialing in again right now; what it had not started may wait for
        its Ready when no other replica serves."""
        if handle.lost:
            return
        handle.lost = True
        handle.error = reason
        handle.exited.set()
        self.door.routes.discard(handle.worker_id)
        self.router.forget(handle.worker_id)
        remote = handle.remote
        assert remote is not None
        where = f"on {remote.address} (worker {remote.name!r})"
        slot = self.catalog.slots.get(handle.config.name)
        message = f"the worker of model {handle.config.name!r} {where} was lost: {reason}"
        self.calls.fail(handle.worker_id, message)
        held = list(handle.streams.values())
        handle.streams.clear()
        if slot is None:
            for stream in held:
                stream.fail(ErrorCode.WORKER_DIED, message)
            return
        started = [s for s in held if s.received]
        fresh = [s for s in held if not s.received]
        for stream in started:
            stream.fail(
                ErrorCode.WORKER_DIED,
                f"{message}; the request had started there and is not sent again",
            )
        slot.died += len(started)
        slot.replayed += len(fresh)
        log.error(
            "model %s: worker %s %s lost: %s; %d request(s) sent again, %d ended",
            slot.name,
            handle.worker_id,
            where,
            reason,
            len(fresh),
            len(started),
        )
        replicas = [] if self.closing else slot.replicas()
        for stream in fresh:
            if self.closing:
                stream.fail(ErrorCode.SHUTTING_DOWN, f"{message}; the gateway is shutting down")
            elif replicas:
                self.recovery.send(slot, self.router.choose(replicas, None), stream)
            else:
                slot.replay.append(stream)
        if slot.replay and not replicas and not back and not self.closing:
            self._no_replica(slot, message)
        self._forget_identity(slot)
        self.released(slot)

    def _forget_identity(self, slot: Slot) -> None:
        """Nothing serves a model whose weights only its replicas knew: the next replica
        says again what they are (the weights may have been updated meanwhile)."""
        own = slot.handle is not None or Path(slot.config.source).expanduser().is_dir()
        if not own and not slot.ready_remotes():
            slot.identity = None

    def _no_replica(self, slot: Slot, message: str) -> None:
        """Requests wait and no replica serves: the model's own worker, if it may have one."""
        if slot.handle is not None or slot.loading is not None or slot.restarting:
            return  # it comes: its Ready sends them
        if slot.config.placement == "local" and slot.config.on_demand == "load":
            task = self.load_local(slot)
            if isinstance(task, asyncio.Task):  # a load that fails ends what waited for it
                task.add_done_callback(lambda t: self._load_done(slot, t, message))
            return
        failed, slot.replay = slot.replay, []
        for stream in failed:
            stream.fail(ErrorCode.WORKER_UNAVAILABLE, f"{message}; no other worker serves it now")

    def _load_done(self, slot: Slot, task: asyncio.Task[object], message: str) -> None:
        failed_load = task.cancelled() or task.exception() is not None
        if failed_load and slot.handle is None and not slot.replicas():
            failed, slot.replay = slot.replay, []
            for stream in failed:
                stream.fail(
                    ErrorCode.WORKER_UNAVAILABLE,
                    f"{message}; the model's own worker failed to load",
                )

    def _drop(self, slot: Slot, handle: WorkerHandle) -> None:
        handle.lost = True
        handle.exited.set()
        self.door.routes.discard(handle.worker_id)
        self.by_id.pop(handle.worker_id, None)
        if handle in slot.remotes:
            slot.remotes.remove(handle)

    def refuse(self, worker_id: str, reason: str) -> None:
        """To the connection holding `worker_id` on the worker port (never a local worker)."""
        log.warning("worker %.80r refused: %s", worker_id, reason)
        self.door.send(worker_id, Refuse(reason), quiet=True)

    def rejoin(self, worker_id: str) -> None:
        now = time.monotonic()
        if now - self._rejoin_sent.get(worker_id, -REJOIN_EVERY_S) < REJOIN_EVERY_S:
            return
        if len(self._rejoin_sent) > 1000:
            self._rejoin_sent.clear()
        self._rejoin_sent[worker_id] = now
        known = self.by_id.get(worker_id)  # lost: the session it was lost in
        session = known.remote.session if known is not None and known.remote else -1
        frame = Rejoin("the gateway does not know this worker", session)
        self.door.send(worker_id, frame, quiet=True)

    # ---- watching them ----------------------------------------------------------------

    def disconnected(self) -> None:
        """A connection closed: a worker whose requests socket is gone is lost (checked at
        once and again shortly after, while ZeroMQ finishes closing its pipe; any number of
        closes meanwhile share that second check)."""
        if self.closing:
            return
        if self._recheck is not None:
            self._again = True  # one more check after the pending one
            return
        self._check_reachable()
        self._recheck = asyncio.get_running_loop().call_later(RECHECK_S, self._rechecked)

    def _rechecked(self) -> None:
        self._recheck = None
        if self.closing:
            return
        self._check_reachable()
        if self._again:
            self._again = False
            self._recheck = asyncio.get_running_loop().call_later(RECHECK_S, self._rechecked)

    def _check_reachable(self) -> None:
        for handle in self.live():
            if not self.door.reachable(handle.worker_id):
                self.lose(handle, "its connection closed")

    def check_keys(self) -> None:
        """Workers whose key was removed, and workers not Ready within load_timeout_s of
        their Hello, are lost."""
        allowed = self.door.allowed.refresh()
        now = time.time()
        for handle in self.live():
            assert handle.remote is not None
            if handle.remote.public_key not in allowed:
                self.lose(handle, "its key was removed (gatewayctl workers remove)")
                self.refuse(handle.worker_id, "its key was removed")
            elif not handle.is_ready and now - handle.started_at > self.load_timeout_s:
                self.lose(
                    handle, f"not ready within server.load_timeout_s={self.load_timeout_s:g}s"
                )

    async def watch_keys(self) -> None:
        while True:
            await asyncio.sleep(KEY_CHECK_S)
            try:
                self.check_keys()
            except Exception:
                log.exception("checking the workers' keys failed")

    async def drain(self, timeout: float) -> None:
        """At shutdown: the requests on remote workers may finish for `timeout` seconds;
        those left then end with shutting_down, as do those waiting for a worker."""
        self.closing = True
        if self._recheck is not None:
            self._recheck.cancel()
            self._recheck = None
        deadline = time.monotonic() + timeout
        while any(h.streams for h in self.live()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for handle in self.live():
            held = list(handle.streams.values())
            handle.streams.clear()
            for stream in held:
                stream.fail(ErrorCode.SHUTTING_DOWN, "the gateway is shutting down")
            if held:
                self.door.send(handle.worker_id, Abort([s.request_id for s in held]))
        for slot in self.catalog:
            waiting, slot.replay = slot.replay, []
            for stream in waiting:
                stream.fail(ErrorCode.SHUTTING_DOWN, "the gateway is shutting down")


def identity(slot: Slot) -> str | None:
    """The weights the model's replicas must serve: what its source folder on this machine
    holds, else what its first replica served (None: not known yet)."""
    if slot.identity is None:
        path = Path(slot.config.source).expanduser()
        if path.is_dir():
            slot.identity = model_identity(path) or None
    return slot.identity
