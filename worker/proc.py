"""The worker process: one model, three threads.

Main thread: load the model and run the engine loop (MLX streams belong to the thread that
made them). Input thread: socket -> engine queue (decoding and tokenizing on the way). Output
thread: queue -> socket, plus a heartbeat every second, also while the model loads.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import psutil
import zmq

from shared.config import ModelConfig
from shared.modelinfo import kind_in, model_identity
from shared.protocol import (
    PROTOCOL_VERSION,
    UNDECODABLE,
    Abort,
    Add,
    Codec,
    Control,
    Hello,
    Ready,
    Refuse,
    Rejoin,
    Shutdown,
    ShutdownMode,
    StepOutputs,
    WorkerDead,
    WorkerState,
)
from shared.types import ErrorCode, FinishReason, RequestError, RequestOutput
from worker import lifeline
from worker.calls import answer
from worker.channels import RemoteLink, WorkerChannels
from worker.faults import Faults
from worker.link import REFUSED, Joins, LinkWatch, Rejoined, leave
from worker.loader import resolve_source
from worker.lockstep import IDLE_TICK_S, Lockstep, Turn
from worker.memory import IdleRelease, MemoryLimits, heartbeat, own_memory
from worker.opening import Engine, open_model
from worker.preprocess import PreparedRequest, PreprocessError, Preprocessor
from worker.prompt_segments import segment_stats

log = logging.getLogger("worker")

HEARTBEAT_S = 1.0
_STOP = object()
WAKE = object()  # into the engine's inputs: something it waits for is ready (nothing to do)


@dataclass(frozen=True, slots=True)
class WorkerArgs:
    worker_id: str
    requests_addr: str
    outputs_addr: str
    model: ModelConfig
    watch_parent: bool = True
    link: RemoteLink | None = None  # on another machine: dial the gateway over TCP


class WorkerProc:
    def __init__(self, args: WorkerArgs) -> None:
        self.args = args
        self.worker_id = args.worker_id
        link = args.link
        if link is None:
            self.channels = WorkerChannels.connect(
                args.worker_id, args.requests_addr, args.outputs_addr
            )
        else:
            self.channels = WorkerChannels.dial(args.worker_id, link)
        self.link_watch = (
            LinkWatch(self.channels.events, link.endpoint, link.public_key, self.channels.drops)
            if link is not None and self.channels.events is not None
            else None
        )
        self.ready: Ready | None = None  # said again when the gateway asks it to rejoin
        self.lockstep: Lockstep | None = None  # rank 0 of a sharded model's group
        self.preprocess: Any = None
        self.joins = Joins()  # a worker on another machine: its sessions (input thread)
        self.session = 0  # the session of the requests the engine runs (engine thread)
        self.step_seq = 0  # the engine's step outputs this session (refusals: self.joins)
        self.refusals = Codec()  # the thread that prepares requests encodes their refusals
        self.inputs: queue.Queue[object] = queue.Queue()
        self.outbox: queue.Queue[object] = queue.Queue()
        self.state = WorkerState.STARTING
        self.engine: Engine | None = None
        self.draining_until: float | None = None
        self.stopping = threading.Event()
        self.outputs_thread = threading.Thread(target=self._output_loop, name="output", daemon=True)
        self.inputs_thread: threading.Thread | None = None
        self.codec = Codec()  # the engine thread's
        self.idle_release = IdleRelease()
        self.faults = Faults.for_model(args.model.name)
        self.stage, self.stage_progress = "starting", -1.0  # reported while loading
        self.limits = MemoryLimits()

    # ---- lifecycle ----------------------------------------------------------------

    def run(self) -> int:
        self.limits = own_memory(self.args.model.engine)  # before any heartbeat reports them
        if self.args.watch_parent:
            lifeline.watch(self.stopping, HEARTBEAT_S)
        if self.link_watch is not None:  # a key the gateway refuses ends it before loading
            self.link_watch.start()
            self.link_watch.wait_connected()
        self._say_hello()  # first: the gateway hears it before any heartbeat
        self.outputs_thread.start()
        try:
            self.state = WorkerState.LOADING
            started = time.monotonic()
            if self.faults.load_delay_s:
                time.sleep(self.faults.load_delay_s)
            log.info("loading model %s from %s", self.args.model.name, self.args.model.source)
            config = self.args.model
            if config.shards > 1:  # the other ranks join (the supervisor started them)
                self._progress("joining the group", -1.0)
                self.lockstep = Lockstep(config.shards, config.hosts.backend)
            group = self.lockstep.group if self.lockstep is not None else None
            path = resolve_source(config, self._progress)
            # what the files say once they are here (a hub id's, downloaded just now)
            kind = config.kind or kind_in(path)
            opened = open_model(
                config, path, kind, self.worker_id, self.faults, self._progress, group
            )
            self._adopt(opened.preprocess)
            self.engine = opened.engine
            for probe in [None, *opened.probes]:
                self._probe(probe)
            ready = opened.ready
            ready.identity = model_identity(path)
            ready.load_time_s = time.monotonic() - started
            self.ready = ready  # a remote worker's input thread says it, after its Hello
            self.inputs_thread = threading.Thread(
                target=self._input_loop, args=(opened.preprocess,), name="input", daemon=True
            )
            self.state = WorkerState.READY
            self.inputs_thread.start()
            if self.args.link is None:
                self._send(ready)
            log.info("ready in %.1fs (probe passed)", time.monotonic() - started)
            if self.faults.crashes_after_ready():
                threading.Timer(self.faults.crash_after_ready_s or 0.0, Faults.die).start()
            self.run_busy_loop()
            return 0
        except Exception as exc:
            self.state = WorkerState.FAILED
            log.exception("worker failed")
            self._fail_all(str(exc))
            self._send(WorkerDead(self.worker_id, str(exc), traceback.format_exc()[-4000:]))
            return 1
        finally:
            self._close()

    def _adopt(self, preprocess: Any) -> None:
        """The model's preprocessor; a grammar it compiles off this thread wakes the engine
        (which waits for inputs while its only requests wait on their grammars)."""
        self.preprocess = preprocess
        if isinstance(preprocess, Preprocessor):
            preprocess.on_compiled = lambda: self.inputs.put(WAKE)

    def _hello(self) -> Hello:
        model = self.args.model.name
        return Hello(self.worker_id, PROTOCOL_VERSION, os.getpid(), model, self.joins.said)

    def _close(self) -> None:
        """Sockets close only once the threads that own them are done (ZeroMQ sockets are
        not thread-safe); a thread stuck on a dead gateway is left to os._exit."""
        self.stopping.set()
        self.outbox.put(_STOP)
        self.outputs_thread.join(timeout=5)
        if self.inputs_thread is not None:
            self.inputs_thread.join(timeout=2)
        threads = [self.outputs_thread, self.inputs_thread]
        if self.link_watch is not None:
            self.link_watch.stopping.set()
            self.link_watch.thread.join(timeout=1)
            threads.append(self.link_watch.thread)
        if not any(t is not None and t.is_alive() for t in threads):
            self.channels.close()  # the output socket lingers so the last frames leave

    def _progress(self, stage: str, fraction: float) -> None:
        self.stage, self.stage_progress = stage, fraction

    def _probe(self, prepared: PreparedRequest | None = None) -> None:
        """Ready means ready: one real token through the batch, or the load failed."""
        assert self.engine is not None
        self.state = WorkerState.PROBING
        self._progress("probing", -1.0)
        try:
            if self.faults.probe_error:
                raise RuntimeError(f"the probe failed: {self.faults.probe_error}")
            if prepared is None:
                self.engine.probe()
            else:
                self.engine.probe(prepared=prepared)
        except Exception as exc:
            raise RuntimeError(f"the model loaded but cannot generate: {exc}") from exc

    def run_busy_loop(self) -> None:
        while self.state != WorkerState.FAILED and not self._drained():
            self._process_inputs()
            self._step()
        if self.lockstep is not None:  # the other ranks leave with it
            self.lockstep.share(Turn(stop=True))

    def _process_inputs(self) -> None:
        """Whatever arrived, into the engine; an idle engine blocks here (no CPU spin)."""
        assert self.engine is not None
        outputs: list[RequestOutput] = []
        # a sharded group's idle turns come a tick apart (worker/lockstep.py)
        idle_wait = HEARTBEAT_S if self.lockstep is None else IDLE_TICK_S
        items = self._take(block=not self.engine.can_step, timeout=idle_wait)
        if self.lockstep is not None:  # raw frames, shared with the other ranks first
            items = self._share(items)
        for item in items:
            if isinstance(item, Rejoined) and outputs:  # the old session's, sent as such
                self._emit(outputs)
                outputs = []
            if isinstance(item, Add):  # shared: prepared here, in order (after a Shutdown
                item = self._accept(item, self.preprocess)  # in the same turn: refused)
                if item is None:
                    continue
            outputs += self._handle(item)
        if outputs:
            self._emit(outputs)

    def _share(self, items: list[object]) -> list[object]:
        """Rank 0's turn, handled alike on every rank: the frames it received, and a drain's
        end decided here (time is rank 0's alone) as an Abort of what is left."""
        assert self.engine is not None and self.lockstep is not None
        frames = [item for item in items if isinstance(item, bytes)]
        engine, until = self.engine, self.draining_until
        if until is not None and time.monotonic() >= until and engine.has_work:
            frames.append(self.codec.encode(Abort(engine.request_ids())))
        return [
            self.codec.to_worker.decode(raw) for raw in self.lockstep.share(Turn(frames)).frames
        ]

    def _step(self) -> None:
        engine = self.engine
        assert engine is not None
        busy = engine.has_work
        if busy:
            outputs = engine.step()
            if outputs:
                self._emit(outputs)
            engine.settle()  # what the step put off until its outputs were out
        if self.idle_release.due(busy, time.monotonic()):
            engine.backend.release_memory()

    def _take(self, block: bool, timeout: float) -> list[object]:
        items: list[object] = []
        if block:
            try:
                items.append(self.inputs.get(timeout=timeout))
            except queue.Empty:
                return items
        while True:
            try:
                items.append(self.inputs.get_nowait())
            except queue.Empty:
                return items

    def _handle(self, item: object) -> list[RequestOutput]:
        assert self.engine is not None
        if item is WAKE:
            return []
        if isinstance(item, Abort):
            return self.engine.abort(item.request_ids)
        if isinstance(item, Shutdown):
            return self._shutdown(item)
        if isinstance(item, Rejoined):
            return self._rejoin(item)
        failed = self._add(item)  # a prepared request of the model's kind
        return [failed] if failed is not None else []

    def _add(self, prepared: Any) -> RequestOutput | None:
        """A request the engine refuses fails alone; the worker keeps serving."""
        assert self.engine is not None
        try:
            return self.engine.add(prepared)
        except Exception as exc:  # one bad request must never take the worker down
            log.warning(
                "request %s refused by the engine: %s",
                prepared.request_id,
                exc,
                extra={"request_id": prepared.request_id},
            )
            error = RequestError(ErrorCode.INVALID_REQUEST, str(exc))
            return RequestOutput(prepared.request_id, finish_reason=FinishReason.ERROR, error=error)

    def _shutdown(self, frame: Shutdown) -> list[RequestOutput]:
        assert self.engine is not None
        self.state = WorkerState.DRAINING
        if frame.mode == ShutdownMode.ABORT:
            self.draining_until = time.monotonic()
            return self.engine.abort(self.engine.request_ids())
        self.draining_until = time.monotonic() + frame.timeout_s
        return []

    def _say_hello(self) -> None:
        """A worker on another machine says it on its requests socket (the gateway ties
        the socket's routing id, its worker id, to the key it proved): from the main thread
        before the input thread starts, then from the input thread only. A local worker
        says it on its output socket, through the outbox."""
        if self.args.link is None:
            self._send(self._hello())
        else:
            self.channels.requests.send(self.codec.encode(self._hello()))

    def _rejoin(self, item: Rejoined) -> list[RequestOutput]:
        """The worker joined again (the input thread said Hello and Ready): what ran here is
        nobody's now, and nobody waits for its end; later outputs are the new session's."""
        assert self.engine is not None
        self.engine.abort(self.engine.request_ids())
        self.session, self.step_seq = item.session, 0
        return []

    def _join_again(self, sock: zmq.Socket[bytes], codec: Codec, why: str) -> None:
        """Input thread: Hello and Ready again in a new session, on the requests socket (one
        connection: in that order), then the engine drops what it ran. Requests that arrive
        after are queued behind that."""
        session = self.joins.again(why)
        if session is not None:
            if self.link_watch is not None:
                self.link_watch.joining()
            sock.send(codec.encode(self._hello()))
            if self.ready is not None:
                sock.send(codec.encode(self.ready))
            self.inputs.put(Rejoined(session))

    def _drained(self) -> bool:
        if self.draining_until is None or self.engine is None:
            return False
        if self.lockstep is not None:  # its drain's end goes through _share
            return not self.engine.has_work
        if self.engine.has_work and time.monotonic() >= self.draining_until:
            outputs = self.engine.abort(self.engine.request_ids())
            self._emit(outputs)
        return not self.engine.has_work

    def _fail_all(self, reason: str) -> None:
        ids = self.engine.request_ids() if self.engine is not None else []
        if not ids:
            return
        error = RequestError(ErrorCode.WORKER_DIED, f"the worker failed: {reason}")
        outputs = [RequestOutput(rid, finish_reason=FinishReason.ERROR, error=error) for rid in ids]
        self._emit(outputs)

    # ---- input thread -----------------------------------------------------------------

    def _input_loop(self, preprocess: Any) -> None:
        codec = Codec()
        sock = self.channels.requests
        link = self.link_watch
        if link is not None and self.ready is not None:  # after its Hello, on one connection
            sock.send(codec.encode(self.ready))
        while not self.stopping.is_set():
            # once every connection is back (a second after a join at the earliest)
            if link is not None and link.dropped.is_set() and link.whole and self.joins.due():
                self._join_again(sock, codec, "a connection to it dropped")
            try:
                if not sock.poll(200):
                    continue
                raw = sock.recv()
            except zmq.ZMQError:  # socket closed at exit
                return
            try:
                frame = codec.to_worker.decode(raw)
            except UNDECODABLE as exc:  # one bad frame must never deafen the worker
                log.warning(
                    "undecodable frame from the gateway (%d bytes), dropped: %s", len(raw), exc
                )
                continue
            item: object | None = frame
            if isinstance(frame, Refuse):
                leave(REFUSED, f"the gateway refused this worker: {frame.reason}")
            if isinstance(frame, Rejoin):  # (about a session this worker has left already: no)
                if not 0 <= frame.session < self.joins.said:
                    self._join_again(sock, codec, f"it asks this worker to rejoin: {frame.reason}")
                continue
            if self.lockstep is not None and isinstance(frame, Add | Abort | Shutdown):
                item = raw  # prepared on the engine thread, with the other ranks
            elif isinstance(frame, Add):
                # sent before this worker joined again: the gateway sends it again
                stale = frame.session != self.joins.said
                item = None if stale else self._accept(frame, preprocess)
            elif isinstance(frame, Control):
                self._send(answer(self.worker_id, self.engine, frame, preprocess))
                item = None
            if item is not None:
                self.inputs.put(item)
            if isinstance(preprocess, Preprocessor):  # segment checks, off their path (a
                preprocess.run_checks()  # refused request's too)

    def _accept(self, frame: Add, preprocess: Any) -> Any:
        """The request, prepared for the engine; None when it was refused (the error went
        back to the gateway)."""
        received = time.perf_counter()
        try:
            if self.state == WorkerState.DRAINING:
                raise PreprocessError(
                    RequestError(ErrorCode.SHUTTING_DOWN, "the model is being unloaded")
                )
            prepared = preprocess(frame)
            prepared.received_at, prepared.prepared_at = received, time.perf_counter()
            self.faults.on_accept(frame)
            log.debug(
                "request %s accepted (%d prompt tokens, priority %d)",
                frame.request_id,
                len(getattr(prepared, "prompt", ())),
                prepared.priority,
                extra={"request_id": frame.request_id},
            )
            return prepared
        except PreprocessError as exc:
            log.info(
                "request %s rejected: %s",
                frame.request_id,
                exc.error.message,
                extra={"request_id": frame.request_id},
            )
            error = exc.error
        except Exception as exc:  # a preprocessor's bug must not end the input thread
            log.exception("preparing request %s failed", frame.request_id)
            error = RequestError(ErrorCode.INTERNAL, f"preparing the request failed: {exc}")
        out = RequestOutput(frame.request_id, finish_reason=FinishReason.ERROR, error=error)
        step = StepOutputs(self.worker_id, -1, [out], self.joins.said, self.joins.seq + 1)
        self._send(self.refusals.encode(step))  # encoded here: its number is taken only then
        self.joins.seq += 1
        return None

    # ---- output thread ----------------------------------------------------------------

    def _emit(self, outputs: list[RequestOutput]) -> None:
        """Engine thread only: deltas go straight out on its own socket, no thread hop."""
        assert self.engine is not None
        seq = self.step_seq + 1  # taken once the frame is out: a failed send leaves no gap
        step = StepOutputs(self.worker_id, self.engine.steps, outputs, self.session, seq)
        self.channels.steps.send(self.codec.encode(step))
        self.step_seq = seq
        if log.isEnabledFor(logging.DEBUG):
            for o in outputs:
                if o.finish_reason is not None:
                    tokens = o.usage.completion_tokens if o.usage else 0
                    log.debug(
                        "request %s finished (%s, %d tokens)",
                        o.request_id,
                        o.finish_reason.value,
                        tokens,
                        extra={"request_id": o.request_id},
                    )

    def _send(self, frame: object) -> None:
        self.outbox.put(frame)

    def _output_loop(self) -> None:
        codec = Codec()
        sock = self.channels.outputs
        process = psutil.Process()
        # the first frame out is the Hello queued before this thread started; beats follow
        next_beat = time.monotonic() + HEARTBEAT_S
        while True:
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + HEARTBEAT_S
                try:
                    stage = "" if self.state == WorkerState.READY else self.stage
                    where = (self.state, stage, self.stage_progress)
                    memo = segment_stats(self.preprocess)
                    hb = heartbeat(self.worker_id, where, self.engine, self.limits, process, memo)
                    beat = codec.encode(hb)
                except Exception:  # a bug: log it, keep the thread (and the outbox) alive
                    log.exception("cannot make a heartbeat")
                else:
                    sock.send(beat)
            try:
                frame = self.outbox.get(timeout=max(0.0, next_beat - time.monotonic()))
            except queue.Empty:
                continue
            if frame is _STOP:
                return
            try:
                data = frame if isinstance(frame, bytes) else codec.encode(frame)  # type: ignore[arg-type]
            except (TypeError, ValueError, OverflowError):  # a bug: log it, keep beating
                log.exception("cannot encode %s", type(frame).__name__)
                continue
            sock.send(data)
