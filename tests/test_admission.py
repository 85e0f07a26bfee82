"""The worker's admission policy: bursts of returning clients start together.

Driven on a real WorkerProc (its sockets dial nowhere) with a thread feeding its input queue
the way the input thread does, at controlled spacings; the hold rule runs a real engine on
conftest's tiny chat model.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import zmq

from shared.config import EngineOptions, ModelConfig
from shared.protocol import Abort, Shutdown, ShutdownMode
from shared.types import FinishReason, SamplingParams, Usage
from tests.engine_fixtures import Loaded, greedy
from worker.daemon import WorkerArgs, WorkerProc
from worker.engine import EngineCore
from worker.preprocess import PreparedRequest

MakeProc = Callable[..., WorkerProc]


def _request(i: int) -> PreparedRequest:
    return PreparedRequest(f"r{i}", [1, 2, 3], 4, SamplingParams())


@pytest.fixture
def make_proc(tmp_path: Path, chat: Loaded) -> Iterator[MakeProc]:
    made: list[WorkerProc] = []

    def make(**engine: Any) -> WorkerProc:
        options = EngineOptions(**({"prefill_batch_size": 8, "admission_gap_ms": 20.0} | engine))
        model = ModelConfig(name="m", source="unused", engine=options)
        addr = f"ipc://{tmp_path}/nobody.sock"
        proc = WorkerProc(WorkerArgs("w-test", addr, addr, model, watch_parent=False))
        proc.engine = EngineCore(chat.model, chat.tokenizer, options)
        made.append(proc)
        return proc

    yield make
    for proc in made:
        for sock in (proc.channels.steps, proc.channels.outputs):
            sock.setsockopt(zmq.LINGER, 0)  # frames emitted to nobody: do not wait for them
        proc.channels.close()


def _feed(proc: WorkerProc, items: list[object], spacing_s: float) -> threading.Thread:
    def run() -> None:
        for item in items:
            time.sleep(spacing_s)
            proc.inputs.put(item)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _held(proc: WorkerProc) -> list[str]:
    return [p.request_id for p in proc.held]


@dataclass(frozen=True)
class Gathering:
    """An idle engine woken with `held` requests: `arriving` more come `spacing_s` apart."""

    returning: int  # requests finished since the last admission
    held: int
    arriving: int
    spacing_s: float
    gathered: tuple[int, int]  # bounds on the requests held after the gathering
    waited: tuple[float, float] = (0.0, 0.2)  # bounds on its duration, seconds
    incoming: int = 0  # frames in the input thread's hands
    engine: dict[str, Any] = field(default_factory=dict)


GATHERINGS = {
    # four came back: it stops as soon as they are all there, not at the end of the window
    "returning-clients": Gathering(4, 1, 3, 0.005, (4, 4), (0.0, 0.045)),
    # a lone client waits the first wait only; the late arrival is left for the next turn
    "lone-client": Gathering(
        1, 1, 1, 0.040, (1, 1), (0.0, 0.030), engine={"admission_first_wait_ms": 5}
    ),
    "first-wait-off": Gathering(
        0,
        1,
        1,
        0.005,
        (1, 1),
        (0.0, 0.025),
        engine={"admission_gap_ms": 50, "admission_first_wait_ms": 0},
    ),
    # the first of a burst reached the engine alone: a second within the first wait starts
    # a gathering of the rest
    "second-within-first-wait": Gathering(
        0, 1, 5, 0.004, (6, 6), engine={"admission_first_wait_ms": 20, "admission_gap_ms": 30}
    ),
    # no client came back (a cold start, a fan-out): a burst is recognised by a second
    # request already held or by frames in the input thread's hands, and gathered until
    # arrivals stop for the gap
    "new-burst-two-held": Gathering(
        0, 2, 4, 0.005, (6, 6), (0.02, 0.2), engine={"admission_gap_ms": 30}
    ),
    "new-burst-incoming": Gathering(
        0, 1, 4, 0.005, (5, 5), (0.02, 0.2), incoming=1, engine={"admission_gap_ms": 30}
    ),
    # four came back but sixteen arrive (the next level of a benchmark): arrivals within the
    # first wait still belong to the burst
    "wider-burst": Gathering(
        4, 1, 15, 0.002, (16, 16), engine={"admission_first_wait_ms": 10, "admission_gap_ms": 30}
    ),
    "stops-at-a-gap": Gathering(
        5, 1, 2, 0.060, (1, 1), engine={"admission_gap_ms": 10, "admission_window_ms": 500}
    ),
    "bounded-by-the-window": Gathering(
        8, 1, 7, 0.015, (2, 7), engine={"admission_gap_ms": 30, "admission_window_ms": 40}
    ),
    "bounded-by-the-batch": Gathering(
        6, 1, 5, 0.002, (2, 2), engine={"max_running": 2, "prefill_batch_size": 2}
    ),
    "off-with-a-zero-gap": Gathering(4, 1, 1, 0.002, (1, 1), engine={"admission_gap_ms": 0}),
}


@pytest.mark.parametrize("case", GATHERINGS.values(), ids=GATHERINGS.keys())
def test_gathering(make_proc: MakeProc, case: Gathering) -> None:
    proc = make_proc(**case.engine)
    proc.returning = case.returning
    proc.held = [_request(i) for i in range(case.held)]
    proc.incoming = case.incoming
    total = case.held + case.arriving
    feeder = _feed(proc, [_request(i) for i in range(case.held, total)], case.spacing_s)
    started = time.monotonic()
    assert proc._gather() == []
    waited = time.monotonic() - started
    feeder.join()
    gathered = len(proc.held)
    assert case.gathered[0] <= gathered <= case.gathered[1]
    assert _held(proc) == [f"r{i}" for i in range(gathered)]  # in arrival order
    assert proc.inputs.qsize() == total - gathered  # the rest waits for the next turn
    assert case.waited[0] <= waited < case.waited[1]


def test_an_aborted_held_request_ends_with_usage(make_proc: MakeProc, chat: Loaded) -> None:
    proc = make_proc()
    proc.held = [_request(0), _request(1)]
    outputs = proc._handle(Abort(["r0", "unknown"]))
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("r0", FinishReason.ABORT)]
    assert outputs[0].usage == Usage(prompt_tokens=3, completion_tokens=0)
    assert _held(proc) == ["r1"]


def test_a_shutdown_admits_held_requests_before_draining(make_proc: MakeProc, chat: Loaded) -> None:
    proc = make_proc()
    proc.held = [_request(0)]
    assert proc._handle(Shutdown(ShutdownMode.DRAIN, 5.0)) == []
    assert proc.held == [] and "r0" in proc.engine.requests  # type: ignore[union-attr]
    proc.engine.abort(["r0"])  # type: ignore[union-attr]


def _step_until(proc: WorkerProc, done: Callable[[], bool], limit: int = 200) -> None:
    for _ in range(limit):
        if done():
            return
        proc._step()
    raise AssertionError("condition not reached")


def test_a_batch_about_to_end_finishes_before_newcomers_start(
    make_proc: MakeProc, chat: Loaded
) -> None:
    proc = make_proc(admission_hold_steps=4)
    engine = proc.engine
    assert engine is not None
    prompt = chat.tokenizer.encode("The gateway starts one worker")
    for i in range(2):
        engine.add(greedy(f"old{i}", prompt, 10, ignore_eos=True))
    # Far from the end: a newcomer is admitted at once.
    _step_until(proc, lambda: engine.requests["old0"].completion_tokens >= 2)
    assert not engine.ending_within(4)
    proc.inputs.put(greedy("early", prompt, 30, ignore_eos=True))
    proc._process_inputs()
    assert "early" in engine.requests
    # Every running request within 4 tokens of its end, but "early" is not: still admitted.
    _step_until(proc, lambda: engine.requests["old0"].completion_tokens >= 7)
    proc.inputs.put(greedy("late", prompt, 8, ignore_eos=True))
    proc._process_inputs()
    assert "late" in engine.requests
    engine.abort(["early", "late"])
    # Now the whole batch ends within 4 steps: newcomers wait for it, then start together.
    _step_until(proc, lambda: engine.ending_within(4))
    for i in range(3):
        proc.inputs.put(greedy(f"new{i}", prompt, 8, ignore_eos=True))
    proc._process_inputs()
    assert _held(proc) == ["new0", "new1", "new2"]
    assert not any(name.startswith("new") for name in engine.requests)
    _step_until(proc, lambda: not engine.has_work)
    proc._process_inputs()
    assert proc.held == [] and sorted(engine.requests) == ["new0", "new1", "new2"]
    engine.abort(list(engine.requests))


def test_the_hold_can_be_switched_off(make_proc: MakeProc, chat: Loaded) -> None:
    proc = make_proc(admission_hold_steps=0)
    engine = proc.engine
    assert engine is not None
    prompt = chat.tokenizer.encode("Hello")
    engine.add(greedy("old", prompt, 4, ignore_eos=True))
    _step_until(proc, lambda: engine.requests["old"].completion_tokens >= 2)
    proc.inputs.put(greedy("new", prompt, 4, ignore_eos=True))
    proc._process_inputs()
    assert "new" in engine.requests
    engine.abort(list(engine.requests))


def test_the_input_thread_publishes_the_frames_it_holds(tmp_path: Path) -> None:
    """Real sockets: frames sent at once are taken off the socket together, `incoming`
    counts the ones not yet queued while a request is being prepared, and when a request is
    queued it counts only those behind it: the engine, woken by the last one, must not wait
    for one more (it did, for `admission_gap_ms`, when the count was lowered after the put)."""
    from shared.protocol import Add, Codec
    from shared.types import CanonicalRequest, RequestKind

    addr = f"ipc://{tmp_path}/requests.sock"
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.bind(addr)
    model = ModelConfig(name="m", source="unused", engine=EngineOptions())
    proc = WorkerProc(WorkerArgs("w-in", addr, f"ipc://{tmp_path}/out.sock", model, False))
    seen: list[int] = []
    at_put: list[int] = []

    class Recording(queue.Queue[object]):
        def put(self, item: object, block: bool = True, timeout: float | None = None) -> None:
            at_put.append(proc.incoming)
            super().put(item, block, timeout)

    proc.inputs = Recording()

    def preprocess(frame: Add) -> PreparedRequest:
        seen.append(proc.incoming)
        time.sleep(0.01)  # templating and tokenizing take time
        return PreparedRequest(frame.request_id, [1, 2], 4, SamplingParams())

    codec = Codec()
    frames = [
        codec.encode(
            Add(f"r{i}", RequestKind.COMPLETION, CanonicalRequest(prompt="x"), SamplingParams())
        )
        for i in range(5)
    ]
    thread = threading.Thread(target=proc._input_loop, args=(preprocess,), daemon=True)
    try:
        for _ in range(200):  # until the DEALER is connected and routable
            try:
                router.send_multipart([b"w-in", frames[0]])
                break
            except zmq.ZMQError:
                time.sleep(0.01)
        for frame in frames[1:]:
            router.send_multipart([b"w-in", frame])
        time.sleep(0.1)  # all five are waiting on the worker's socket
        thread.start()
        got = [proc.inputs.get(timeout=5) for _ in range(5)]
        assert [p.request_id for p in got] == [f"r{i}" for i in range(5)]  # type: ignore[attr-defined]
        assert seen == [5, 4, 3, 2, 1]
        assert at_put == [4, 3, 2, 1, 0]
        for _ in range(100):
            if proc.incoming == 0:
                break
            time.sleep(0.01)
        assert proc.incoming == 0
    finally:
        proc.stopping.set()
        thread.join(timeout=2)
        proc.channels.close()
        router.close(linger=0)
        context.term()


@dataclass(frozen=True)
class Beside:
    """A busy engine (one request running): a request arrives; `returning` finished since
    the last admission."""

    returning: int
    received_ago: float  # when the input thread last took frames, seconds ago
    admitted: bool
    incoming: int = 0
    held_for: float = 0.0  # how long the request has been held, seconds
    engine: dict[str, Any] = field(default_factory=dict)


BESIDES = {
    # three came back, one arrived just now: it waits for the other two
    "more-coming": Beside(3, 0.0, admitted=False),
    "frames-in-the-input-threads-hands": Beside(3, 1.0, admitted=False, incoming=1),
    "arrivals-stopped": Beside(3, 1.0, admitted=True),
    "no-burst": Beside(1, 0.0, admitted=True),
    "no-room-for-more": Beside(3, 0.0, admitted=True, engine={"max_running": 2}),
    "window-passed": Beside(3, 0.0, admitted=True, held_for=2.0),
    "off-with-a-zero-gap": Beside(3, 0.0, admitted=True, engine={"admission_gap_ms": 0}),
}


@pytest.mark.parametrize("case", BESIDES.values(), ids=BESIDES.keys())
def test_a_busy_engine_holds_a_partly_arrived_burst(
    make_proc: MakeProc, chat: Loaded, case: Beside
) -> None:
    proc = make_proc(**({"admission_gap_ms": 200, "admission_window_ms": 1000} | case.engine))
    engine = proc.engine
    assert engine is not None
    prompt = chat.tokenizer.encode("The gateway starts one worker")
    engine.add(greedy("running", prompt, 40, ignore_eos=True))
    _step_until(proc, lambda: engine.requests["running"].completion_tokens >= 2)
    proc.returning, proc.incoming = case.returning, case.incoming
    proc.last_received = time.monotonic() - case.received_ago
    proc.inputs.put(greedy("new", prompt, 4, ignore_eos=True))
    proc._process_inputs()
    if case.held_for:
        proc.held_since -= case.held_for
        proc._process_inputs()
    assert ("new" in engine.requests) is case.admitted
    assert _held(proc) == ([] if case.admitted else ["new"])
    engine.abort(list(engine.requests))


def test_a_burst_beside_a_running_batch_is_admitted_whole(
    make_proc: MakeProc, chat: Loaded
) -> None:
    """Three clients came back while another request runs: the first arrival is held while
    the batch keeps stepping, and all three enter the batch together."""
    proc = make_proc(admission_gap_ms=200, admission_window_ms=2000)
    engine = proc.engine
    assert engine is not None
    prompt = chat.tokenizer.encode("The gateway starts one worker")
    engine.add(greedy("running", prompt, 60, ignore_eos=True))
    _step_until(proc, lambda: engine.requests["running"].completion_tokens >= 2)
    proc.returning = 3
    proc.last_received = time.monotonic()
    proc.inputs.put(greedy("new0", prompt, 4, ignore_eos=True))
    proc._process_inputs()
    before = engine.requests["running"].completion_tokens
    proc._step()
    assert engine.requests["running"].completion_tokens == before + 1  # not stalled
    assert _held(proc) == ["new0"] and "new0" not in engine.requests
    proc.last_received = time.monotonic()
    for i in (1, 2):
        proc.inputs.put(greedy(f"new{i}", prompt, 4, ignore_eos=True))
    proc._process_inputs()
    assert proc.held == [] and {"new0", "new1", "new2"} <= set(engine.requests)
    assert proc.returning == 0
    engine.abort(list(engine.requests))
