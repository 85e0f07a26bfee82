"""The worker's admission of a burst: an idle engine gathers the requests it expects back.

Driven on a real WorkerProc (its sockets dial nowhere) with a thread feeding its input queue
the way the input thread does, at controlled spacings.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from shared.config import EngineOptions, ModelConfig
from shared.protocol import Abort, Shutdown, ShutdownMode
from shared.types import SamplingParams
from worker.daemon import WorkerArgs, WorkerProc
from worker.preprocess import PreparedRequest


def _request(i: int) -> PreparedRequest:
    return PreparedRequest(f"r{i}", [1, 2, 3], 4, SamplingParams())


@pytest.fixture
def make_proc(tmp_path: object) -> Iterator[object]:
    made: list[WorkerProc] = []

    def make(gap_ms: float = 20.0, window_ms: float = 50.0, batch: int = 8) -> WorkerProc:
        engine = EngineOptions(
            prefill_batch_size=batch, admission_gap_ms=gap_ms, admission_window_ms=window_ms
        )
        model = ModelConfig(name="m", source="unused", engine=engine)
        addr = f"ipc://{tmp_path}/none.sock"
        proc = WorkerProc(WorkerArgs("w-test", addr, addr, model, watch_parent=False))
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


def test_a_burst_of_returning_clients_is_admitted_together(make_proc) -> None:
    proc = make_proc()
    proc.returning = 4  # four requests finished since the last admission
    feeder = _feed(proc, [_request(i) for i in range(1, 4)], spacing_s=0.005)
    started = time.monotonic()
    items = proc._coalesce(_request(0))
    feeder.join()
    assert [i.request_id for i in items] == ["r0", "r1", "r2", "r3"]
    # It stopped as soon as the expected four were in, not at the end of the window.
    assert time.monotonic() - started < 0.045


def test_a_lone_client_never_waits(make_proc) -> None:
    proc = make_proc()
    proc.returning = 1
    feeder = _feed(proc, [_request(1)], spacing_s=0.005)
    items = proc._coalesce(_request(0))
    assert [i.request_id for i in items] == ["r0"]
    feeder.join()
    assert proc.inputs.qsize() == 1  # left for the next step


def test_gathering_stops_at_a_gap(make_proc) -> None:
    proc = make_proc(gap_ms=10, window_ms=500)
    proc.returning = 5
    feeder = _feed(proc, [_request(1), _request(2)], spacing_s=0.060)
    items = proc._coalesce(_request(0))
    assert [i.request_id for i in items] == ["r0"]  # r1 came 60 ms later: over the gap
    feeder.join()


def test_gathering_is_bounded_by_the_window(make_proc) -> None:
    proc = make_proc(gap_ms=30, window_ms=40)
    proc.returning = 8
    feeder = _feed(proc, [_request(i) for i in range(1, 8)], spacing_s=0.015)
    started = time.monotonic()
    items = proc._coalesce(_request(0))
    waited = time.monotonic() - started
    feeder.join()
    assert 1 < len(items) < 8
    assert waited < 0.2


def test_gathering_is_bounded_by_the_prefill_batch(make_proc) -> None:
    proc = make_proc(batch=2)
    proc.returning = 6
    feeder = _feed(proc, [_request(i) for i in range(1, 6)], spacing_s=0.002)
    items = proc._coalesce(_request(0))
    feeder.join()
    assert [i.request_id for i in items] == ["r0", "r1"]


def test_aborts_and_shutdown_are_kept_in_order(make_proc) -> None:
    proc = make_proc()
    proc.returning = 3
    shutdown = Shutdown(ShutdownMode.DRAIN, 5.0)
    feeder = _feed(proc, [Abort(["r0"]), shutdown, _request(1)], spacing_s=0.002)
    items = proc._coalesce(_request(0))
    feeder.join()
    # The shutdown ends the gathering at once; the later request waits for the next step.
    assert items[0].request_id == "r0" and isinstance(items[1], Abort) and items[2] is shutdown
    assert len(items) == 3


def test_disabled_by_a_zero_gap(make_proc) -> None:
    proc = make_proc(gap_ms=0)
    proc.returning = 4
    feeder = _feed(proc, [_request(1)], spacing_s=0.002)
    assert len(proc._coalesce(_request(0))) == 1
    feeder.join()
