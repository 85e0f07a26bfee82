"""The worker's admission policy: bursts of returning clients start together.

Driven on a real WorkerProc (its sockets dial nowhere) with a thread feeding its input queue
the way the input thread does, at controlled spacings; the hold rule runs a real engine on
conftest's tiny chat model.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.config import EngineOptions, ModelConfig
from shared.protocol import Abort, Shutdown, ShutdownMode
from shared.types import FinishReason, SamplingParams, Usage
from tests.engine_fixtures import Loaded, greedy, load
from worker.daemon import WorkerArgs, WorkerProc
from worker.engine import EngineCore
from worker.preprocess import PreparedRequest

MakeProc = Callable[..., WorkerProc]


def _request(i: int) -> PreparedRequest:
    return PreparedRequest(f"r{i}", [1, 2, 3], 4, SamplingParams())


@pytest.fixture(scope="module")
def chat(chat_model: Path) -> Loaded:
    return load(chat_model)


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


def test_a_burst_of_returning_clients_is_gathered(make_proc: MakeProc) -> None:
    proc = make_proc()
    proc.returning = 4  # four requests finished since the last admission
    proc.held = [_request(0)]
    feeder = _feed(proc, [_request(i) for i in range(1, 4)], spacing_s=0.005)
    started = time.monotonic()
    assert proc._gather() == []
    feeder.join()
    assert _held(proc) == ["r0", "r1", "r2", "r3"]
    # It stopped as soon as the four were back, not at the end of the window.
    assert time.monotonic() - started < 0.045


def test_a_lone_client_waits_only_the_first_wait(make_proc: MakeProc) -> None:
    proc = make_proc(admission_first_wait_ms=5)
    proc.returning = 1
    proc.held = [_request(0)]
    feeder = _feed(proc, [_request(1)], spacing_s=0.040)
    started = time.monotonic()
    proc._gather()
    assert time.monotonic() - started < 0.030
    assert _held(proc) == ["r0"]
    feeder.join()
    assert proc.inputs.qsize() == 1  # left for the next turn of the loop


def test_a_second_request_within_the_first_wait_starts_a_gathering(make_proc: MakeProc) -> None:
    """The first request of a burst that reached the engine alone: the rest is gathered."""
    proc = make_proc(admission_first_wait_ms=20, admission_gap_ms=30)
    proc.returning = 0
    proc.held = [_request(0)]
    feeder = _feed(proc, [_request(i) for i in range(1, 6)], spacing_s=0.004)
    proc._gather()
    feeder.join()
    assert _held(proc) == [f"r{i}" for i in range(6)]


@pytest.mark.parametrize("signal", ["two_held", "incoming"])
def test_a_new_burst_is_gathered_until_arrivals_stop(make_proc: MakeProc, signal: str) -> None:
    """No client came back (a cold start, a level of a benchmark, a fan-out): a burst is
    recognised by a second request already held or by more frames in the input thread's
    hands, and gathered until arrivals stop for the gap, instead of prefilling its first
    request alone and the rest a prefill later."""
    proc = make_proc(admission_gap_ms=30)
    proc.returning = 0
    proc.held = [_request(0), _request(1)] if signal == "two_held" else [_request(1)]
    proc.incoming = 1 if signal == "incoming" else 0
    feeder = _feed(proc, [_request(i) for i in range(2, 6)], spacing_s=0.005)
    started = time.monotonic()
    proc._gather()
    waited = time.monotonic() - started
    feeder.join()
    assert len(proc.held) == (6 if signal == "two_held" else 5)
    assert 0.02 <= waited < 0.2  # arrivals ended, then one gap


def test_no_first_wait_when_it_is_off(make_proc: MakeProc) -> None:
    proc = make_proc(admission_gap_ms=50, admission_first_wait_ms=0)
    proc.returning = 0
    proc.held = [_request(0)]
    feeder = _feed(proc, [_request(1)], spacing_s=0.005)
    started = time.monotonic()
    proc._gather()
    assert time.monotonic() - started < 0.004
    assert _held(proc) == ["r0"]
    feeder.join()


def test_a_burst_larger_than_the_last_one_is_gathered_whole(make_proc: MakeProc) -> None:
    """Four clients came back, but sixteen requests arrive together (the next level of a
    benchmark, a wider fan-out): arrivals within the first wait still belong to the burst."""
    proc = make_proc(admission_first_wait_ms=10, admission_gap_ms=30)
    proc.returning = 4
    proc.held = [_request(0)]
    feeder = _feed(proc, [_request(i) for i in range(1, 16)], spacing_s=0.002)
    proc._gather()
    feeder.join()
    assert len(proc.held) == 16


def test_gathering_stops_at_a_gap(make_proc: MakeProc) -> None:
    proc = make_proc(admission_gap_ms=10, admission_window_ms=500)
    proc.returning = 5
    proc.held = [_request(0)]
    feeder = _feed(proc, [_request(1), _request(2)], spacing_s=0.060)
    proc._gather()
    assert _held(proc) == ["r0"]  # r1 came 60 ms later: past the gap
    feeder.join()


def test_gathering_is_bounded_by_the_window(make_proc: MakeProc) -> None:
    proc = make_proc(admission_gap_ms=30, admission_window_ms=40)
    proc.returning = 8
    proc.held = [_request(0)]
    feeder = _feed(proc, [_request(i) for i in range(1, 8)], spacing_s=0.015)
    started = time.monotonic()
    proc._gather()
    waited = time.monotonic() - started
    feeder.join()
    assert 1 < len(proc.held) < 8
    assert waited < 0.2


def test_gathering_is_bounded_by_the_batch(make_proc: MakeProc) -> None:
    proc = make_proc(max_running=2, prefill_batch_size=2)
    proc.returning = 6
    proc.held = [_request(0)]
    feeder = _feed(proc, [_request(i) for i in range(1, 6)], spacing_s=0.002)
    proc._gather()
    feeder.join()
    assert _held(proc) == ["r0", "r1"]


def test_disabled_by_a_zero_gap(make_proc: MakeProc) -> None:
    proc = make_proc(admission_gap_ms=0)
    proc.returning = 4
    proc.held = [_request(0)]
    feeder = _feed(proc, [_request(1)], spacing_s=0.002)
    proc._gather()
    assert _held(proc) == ["r0"]
    feeder.join()


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
    counts the ones not yet queued while a request is being prepared, and drops to 0 once
    all are queued."""
    import zmq

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
