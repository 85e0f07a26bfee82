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
from collections import deque
from dataclasses import dataclass

import mlx.core as mx
import msgspec
import psutil

from shared.config import ModelConfig
from shared.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Add,
    Capacity,
    Codec,
    Control,
    ControlReply,
    Heartbeat,
    Hello,
    Ready,
    Shutdown,
    ShutdownMode,
    StepOutputs,
    WorkerDead,
    WorkerState,
)
from shared.types import ErrorCode, FinishReason, RequestError, RequestOutput, Usage
from worker.channels import WorkerChannels
from worker.engine import EngineCore
from worker.faults import Faults
from worker.loader import LoadedModel, load_model
from worker.preprocess import PreparedRequest, PreprocessError, Preprocessor, capabilities

log = logging.getLogger("worker")

HEARTBEAT_S = 1.0
INPUT_BATCH = 256  # frames the input thread takes off its socket at once
_STOP = object()


@dataclass(frozen=True, slots=True)
class WorkerArgs:
    worker_id: str
    requests_addr: str
    outputs_addr: str
    model: ModelConfig
    watch_parent: bool = True


class WorkerProc:
    def __init__(self, args: WorkerArgs) -> None:
        self.args = args
        self.worker_id = args.worker_id
        self.channels = WorkerChannels.connect(
            args.worker_id, args.requests_addr, args.outputs_addr
        )
        self.inputs: queue.Queue[object] = queue.Queue()
        self.outbox: queue.Queue[object] = queue.Queue()
        self.state = WorkerState.STARTING
        self.engine: EngineCore | None = None
        self.parent = os.getppid()
        self.draining_until: float | None = None
        self.stopping = threading.Event()
        self.outputs_thread = threading.Thread(target=self._output_loop, name="output", daemon=True)
        self.inputs_thread: threading.Thread | None = None
        self.codec = Codec()  # the engine thread's
        self.returning = 0  # requests finished since the engine last admitted one
        self.held: list[PreparedRequest] = []  # received, not yet in the batch
        self.held_since = 0.0  # when the oldest held request was taken
        # Add frames the input thread has received and not yet queued (it alone writes it):
        # an idle engine woken by one request sees that more of the same burst are coming.
        self.incoming = 0
        self.last_received = 0.0  # when the input thread last took frames off its socket
        self.faults = Faults.for_model(args.model.name)
        self.stage, self.stage_progress = "starting", -1.0  # reported while loading
        self.crash_ids: set[str] = set()  # fault injection: die after their first token
        self.stall_ids: set[str] = set()  # fault injection: stop stepping once added

    # ---- lifecycle ----------------------------------------------------------------

    def run(self) -> int:
        if self.args.watch_parent:
            threading.Thread(target=self._watch_parent, name="parent-watch", daemon=True).start()
        self.outputs_thread.start()
        self._send(Hello(self.worker_id, PROTOCOL_VERSION, os.getpid(), self.args.model.name))
        try:
            self.state = WorkerState.LOADING
            started = time.monotonic()
            if self.faults.load_delay_s:
                time.sleep(self.faults.load_delay_s)
            log.info("loading model %s from %s", self.args.model.name, self.args.model.source)
            loaded = load_model(self.args.model, self._progress)
            self.engine = EngineCore(loaded.model, loaded.tokenizer, self.args.model.engine)
            self._probe()
            preprocess = Preprocessor(loaded.tokenizer, self.args.model.engine, loaded.max_context)
            self.inputs_thread = threading.Thread(
                target=self._input_loop, args=(preprocess,), name="input", daemon=True
            )
            self.inputs_thread.start()
            self.state = WorkerState.READY
            self._send(self._ready(loaded, time.monotonic() - started))
            log.info("ready in %.1fs (probe passed)", time.monotonic() - started)
            if self.faults.crash_after_ready_s is not None:
                threading.Timer(self.faults.crash_after_ready_s, Faults.die).start()
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

    def _close(self) -> None:
        """Sockets close only once the threads that own them are done (ZeroMQ sockets are
        not thread-safe); a thread stuck on a dead gateway is left to os._exit."""
        self.stopping.set()
        self.outbox.put(_STOP)
        self.outputs_thread.join(timeout=5)
        if self.inputs_thread is not None:
            self.inputs_thread.join(timeout=2)
        threads = [self.outputs_thread, self.inputs_thread]
        if not any(t is not None and t.is_alive() for t in threads):
            self.channels.close()  # the output socket lingers so the last frames leave

    def _watch_parent(self) -> None:
        """macOS has no PDEATHSIG: notice re-parenting and exit with the gateway."""
        while not self.stopping.wait(HEARTBEAT_S):
            if os.getppid() != self.parent:
                log.error("the gateway is gone; exiting")
                os._exit(3)

    def _progress(self, stage: str, fraction: float) -> None:
        self.stage, self.stage_progress = stage, fraction

    def _probe(self) -> None:
        """Ready means ready: one real token through the batch, or the load failed."""
        assert self.engine is not None
        self.state = WorkerState.PROBING
        self._progress("probing", -1.0)
        try:
            if self.faults.probe_error:
                raise RuntimeError(f"the probe failed: {self.faults.probe_error}")
            self.engine.probe()
        except Exception as exc:
            raise RuntimeError(f"the model loaded but cannot generate: {exc}") from exc

    def _ready(self, loaded: LoadedModel, load_time: float) -> Ready:
        from importlib.metadata import version

        opts = self.args.model.engine
        return Ready(
            self.worker_id,
            Capacity(opts.max_running, opts.max_waiting, loaded.max_context),
            versions={"mlx": version("mlx"), "mlx_lm": version("mlx-lm")},
            capabilities=capabilities(loaded.tokenizer) + (["demo"] if loaded.is_demo else []),
            load_time_s=load_time,
        )

    # ---- engine loop (main thread) --------------------------------------------------

    def run_busy_loop(self) -> None:
        while self.state != WorkerState.FAILED and not self._drained():
            self._process_inputs()
            self._step()

    def _step(self) -> None:
        assert self.engine is not None
        if self.engine.has_work:
            outputs = self.engine.step()
            if outputs:
                self._emit(outputs)
                self.returning += sum(1 for o in outputs if o.finish_reason is not None)

    # ---- admission ------------------------------------------------------------------
    #
    # New requests are held, then admitted into the BatchGenerator together. A closed loop
    # of clients (a benchmark, an eval harness, agents fanning out) sends its next requests
    # as its previous ones finish, spread over milliseconds of HTTP and preprocessing.
    # Admitting each at once would prefill the first alone and put it a step ahead of the
    # others for good: a desynchronised batch that prefills several times per wave. So:
    # - a batch that will end within `admission_hold_steps` steps (every request is that
    #   close to its max_tokens) finishes first, and its successors start together;
    # - an idle engine woken by a request, when several requests finished since it last
    #   admitted one, gathers arrivals less than `admission_gap_ms` apart until as many
    #   came back (`admission_window_ms` at most). A lone client waits at most
    #   `admission_first_wait_ms` for a second one;
    # - a busy engine holds a partly arrived burst of returning clients the same way while
    #   its batch keeps stepping, so that the burst is prefilled once, not in pieces.

    def _process_inputs(self) -> None:
        engine = self.engine
        assert engine is not None
        finished: list[RequestOutput] = []
        for item in self._take(block=not engine.has_work and not self.held):
            finished += self._handle(item)
        if self.held and not (engine.has_work and (self._batch_ending() or self._arriving())):
            if not engine.has_work:
                finished += self._gather()
            finished += self._admit_held()
        if finished:
            self._emit(finished)

    def _take(self, block: bool) -> list[object]:
        items: list[object] = []
        if block:
            try:
                items.append(self.inputs.get(timeout=HEARTBEAT_S))
            except queue.Empty:
                return items
        while True:
            try:
                items.append(self.inputs.get_nowait())
            except queue.Empty:
                return items

    def _handle(self, item: object) -> list[RequestOutput]:
        assert self.engine is not None
        if isinstance(item, PreparedRequest):
            if not self.held:
                self.held_since = time.monotonic()
            self.held.append(item)
            return []
        if isinstance(item, Abort):
            ids = set(item.request_ids)
            dropped = [p for p in self.held if p.request_id in ids]
            if dropped:
                self.held = [p for p in self.held if p.request_id not in ids]
            outputs = [
                RequestOutput(
                    p.request_id,
                    finish_reason=FinishReason.ABORT,
                    usage=Usage(prompt_tokens=len(p.prompt), completion_tokens=0),
                )
                for p in dropped
            ]
            return outputs + self.engine.abort(item.request_ids)
        if isinstance(item, Shutdown):
            outputs = self._admit_held(everything=True)  # a drain or abort covers them too
            return outputs + self._shutdown(item)
        return []

    def _batch_ending(self) -> bool:
        assert self.engine is not None
        return self.engine.ending_within(self.args.model.engine.admission_hold_steps)

    def _arriving(self) -> bool:
        """A busy engine and a burst of returning clients partly arrived: hold it (the batch
        steps meanwhile) while fewer have arrived than came back and could fit, arrivals
        are still coming (frames in the input thread's hands, or the last less than
        `admission_gap_ms` ago), and the oldest has waited less than `admission_window_ms`.
        Admitted piecemeal, a burst would be prefilled in pieces, one prefill each."""
        assert self.engine is not None
        opts = self.args.model.engine
        expected = min(self.returning, opts.max_running - self.engine.active)
        if opts.admission_gap_ms <= 0 or len(self.held) >= expected:
            return False
        now = time.monotonic()
        if now - self.held_since >= opts.admission_window_ms / 1000:
            return False
        return bool(self.incoming) or now - self.last_received < opts.admission_gap_ms / 1000

    def _gather(self) -> list[RequestOutput]:
        """Idle engine: wait for the rest of a burst. Returning clients: until as many came
        back as finished. Otherwise a lone request waits `admission_first_wait_ms` for a
        second one; a burst (a second request, or more frames in the input thread's hands)
        is gathered until arrivals stop for `admission_gap_ms`. Frames still in the input
        thread's hands are always waited for (within the gap and the window)."""
        opts = self.args.model.engine
        finished: list[RequestOutput] = []
        gap = opts.admission_gap_ms / 1000
        if gap <= 0:
            return finished
        if self.returning <= 1 and len(self.held) == 1 and not self.incoming:
            item = self._next_input(opts.admission_first_wait_ms / 1000)
            if item is None:
                return finished  # a lone client
            finished += self._handle(item)
            if not isinstance(item, PreparedRequest):
                return finished
        # the engine is idle: with no clients returning, a whole batch may come
        expected = min(self.returning, opts.max_running) if self.returning > 1 else opts.max_running
        deadline = time.monotonic() + opts.admission_window_ms / 1000
        first_wait = opts.admission_first_wait_ms / 1000
        while self.held and len(self.held) < opts.max_running:
            # Past the expected count, only what follows within the first wait belongs to
            # the burst (a burst larger than the last one: the next level of a benchmark).
            short = len(self.held) >= expected and not self.incoming
            item = self._next_input(min(first_wait if short else gap, deadline - time.monotonic()))
            if item is None:
                break
            finished += self._handle(item)
            if isinstance(item, Shutdown):
                break
        return finished

    def _next_input(self, wait: float) -> object | None:
        if wait <= 0:
            return None
        try:
            return self.inputs.get(timeout=wait)
        except queue.Empty:
            return None

    def _admit_held(self, everything: bool = False) -> list[RequestOutput]:
        """Move held requests into the batch while it has room: interactive ones first (FIFO
        within a class), batch ones up to `batch_share` of `max_running`."""
        engine = self.engine
        assert engine is not None
        if not self.held:
            return []
        opts = self.args.model.engine
        free = len(self.held) if everything else opts.max_running - engine.active
        batch_room = max(1, int(opts.max_running * opts.batch_share)) - engine.batch_count
        admit: list[PreparedRequest] = []
        keep: list[PreparedRequest] = []
        for prepared in sorted(self.held, key=lambda p: p.priority):
            if len(admit) < free and (everything or prepared.priority == 0 or batch_room > 0):
                admit.append(prepared)
                batch_room -= prepared.priority > 0
            else:
                keep.append(prepared)
        self.held = keep
        if admit:
            self.returning = 0
            self.held_since = time.monotonic()  # for what is left: parked, not a burst
        return [failed for p in admit if (failed := self._add(p)) is not None]

    def _add(self, prepared: PreparedRequest) -> RequestOutput | None:
        """A request the engine refuses fails alone; the worker keeps serving."""
        assert self.engine is not None
        try:
            output = self.engine.add(prepared)
            if prepared.request_id in self.stall_ids:
                self.faults.stall()
            return output
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

    def _drained(self) -> bool:
        if self.draining_until is None or self.engine is None:
            return False
        if self.engine.has_work and time.monotonic() >= self.draining_until:
            outputs = self.engine.abort(self.engine.request_ids())
            self._emit(outputs)
        return not self.engine.has_work

    def _fail_all(self, reason: str) -> None:
        ids = [p.request_id for p in self.held]
        self.held = []
        if self.engine is not None:
            ids += self.engine.request_ids()
        if not ids:
            return
        error = RequestError(ErrorCode.WORKER_DIED, f"the worker failed: {reason}")
        outputs = [RequestOutput(rid, finish_reason=FinishReason.ERROR, error=error) for rid in ids]
        self._emit(outputs)

    # ---- input thread -----------------------------------------------------------------

    def _input_loop(self, preprocess: Preprocessor) -> None:
        codec = Codec()
        sock = self.channels.requests
        pending: deque[bytes] = deque()
        while not self.stopping.is_set():
            try:
                if not pending:
                    if not sock.poll(200):
                        continue
                    pending.append(sock.recv())
                while sock.poll(0) and len(pending) < INPUT_BATCH:  # the rest of a burst
                    pending.append(sock.recv())
                self.incoming = len(pending)
                self.last_received = time.monotonic()
                frame = codec.to_worker.decode(pending.popleft())
            except msgspec.DecodeError:
                log.exception("undecodable frame from the gateway")
                continue
            except Exception:  # socket closed at exit
                return
            item: object | None = frame
            if isinstance(frame, Add):
                item = self._accept(frame, preprocess)
            elif isinstance(frame, Control):
                self._send(self._control(frame, preprocess))
                item = None
            # Frames still in this thread's hands, published before the item is queued: the
            # engine, woken by it, must not count it as one more still coming.
            if pending:
                self.incoming = len(pending)
            else:
                try:
                    self.incoming = 1 if sock.poll(0) else 0  # more came while it worked
                except Exception:  # socket closed at exit
                    return
            if item is not None:
                if isinstance(item, PreparedRequest):
                    self.last_received = time.monotonic()  # preparing took time: gap from here
                self.inputs.put(item)

    def _accept(self, frame: Add, preprocess: Preprocessor) -> PreparedRequest | None:
        """The request, prepared for the engine; None when it was refused (the error went
        back to the gateway)."""
        try:
            if self.state == WorkerState.DRAINING:
                raise PreprocessError(
                    RequestError(ErrorCode.SHUTTING_DOWN, "the model is being unloaded")
                )
            prepared = preprocess(frame)
            if self.faults.crash_on or self.faults.stall_on:
                self._mark_faults(frame)
            log.debug(
                "request %s accepted (%d prompt tokens, priority %d)",
                frame.request_id,
                len(prepared.prompt),
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
            out = RequestOutput(frame.request_id, finish_reason=FinishReason.ERROR, error=exc.error)
            self._send(StepOutputs(self.worker_id, -1, [out]))
            return None

    def _mark_faults(self, frame: Add) -> None:
        text = msgspec.json.encode(frame.request).decode()
        if self.faults.matches(self.faults.crash_on, text):
            if self.faults.crash_before_token:
                Faults.die()
            self.crash_ids.add(frame.request_id)
        if self.faults.matches(self.faults.stall_on, text):
            self.stall_ids.add(frame.request_id)

    def _control(self, frame: Control, preprocess: Preprocessor) -> ControlReply:
        """Calls answered on the input thread, beside the engine loop (never inside it)."""
        try:
            if frame.method == "stats" and self.engine is not None:
                running, waiting = self.engine.counts()
                waiting += len(self.held)
                result = {"running": running, "waiting": waiting, "steps": self.engine.steps}
            elif frame.method == "tokenize":
                result = preprocess.tokenize_call(frame.args)
            elif frame.method == "detokenize":
                result = preprocess.detokenize_call(frame.args)
            else:
                return ControlReply(
                    self.worker_id, frame.call_id, False, error=f"unknown method {frame.method}"
                )
        except PreprocessError as exc:
            return ControlReply(
                self.worker_id,
                frame.call_id,
                False,
                {"code": exc.error.code.value, "param": exc.error.param},
                exc.error.message,
            )
        try:
            msgspec.msgpack.encode(result)
        except (TypeError, ValueError, OverflowError) as exc:  # never let a reply kill a thread
            return ControlReply(
                self.worker_id, frame.call_id, False, error=f"{frame.method}: unencodable: {exc}"
            )
        return ControlReply(self.worker_id, frame.call_id, True, result)

    # ---- output thread ----------------------------------------------------------------

    def _emit(self, outputs: list[RequestOutput]) -> None:
        """Engine thread only: deltas go straight out on its own socket, no thread hop."""
        assert self.engine is not None
        self.channels.steps.send(
            self.codec.encode(StepOutputs(self.worker_id, self.engine.steps, outputs))
        )
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
        if self.crash_ids and any(o.request_id in self.crash_ids for o in outputs):
            time.sleep(0.2)  # let the frame leave: the client must have seen a token
            Faults.die()

    def _send(self, frame: object) -> None:
        self.outbox.put(frame)

    def _output_loop(self) -> None:
        codec = Codec()
        sock = self.channels.outputs
        process = psutil.Process()
        next_beat = 0.0
        while True:
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + HEARTBEAT_S
                sock.send(codec.encode(self._heartbeat(process)))
            try:
                frame = self.outbox.get(timeout=max(0.0, next_beat - time.monotonic()))
            except queue.Empty:
                continue
            if frame is _STOP:
                return
            try:
                data = codec.encode(frame)  # type: ignore[arg-type]
            except (TypeError, ValueError, OverflowError):  # a bug: log it, keep beating
                log.exception("cannot encode %s", type(frame).__name__)
                continue
            sock.send(data)

    def _heartbeat(self, process: psutil.Process) -> Heartbeat:
        running, waiting = self.engine.counts() if self.engine else (0, 0)
        waiting += len(self.held)
        steps = self.engine.steps if self.engine else 0
        return Heartbeat(
            self.worker_id,
            self.state,
            steps,
            running,
            waiting,
            process.memory_info().rss,
            mx.get_active_memory(),
            mx.get_cache_memory(),
            mx.get_peak_memory(),
            "" if self.state == WorkerState.READY else self.stage,
            self.stage_progress,
        )
