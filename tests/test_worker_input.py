"""The worker's input thread over a real ZeroMQ socket: a frame it cannot decode is logged
and dropped, and the frames after it still reach the engine's queue; what is made off that
thread (a grammar) wakes the engine."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from mlx_lm.tokenizer_utils import load as load_tokenizer

from shared.config import EngineOptions, ModelConfig
from shared.protocol import Abort, Add, Codec
from shared.types import (
    CanonicalRequest,
    Message,
    OutputFormat,
    RequestKind,
    ResponseFormat,
    SamplingParams,
)
from tests.test_prompt_segments import user_turns_gain
from worker.preprocess import Preprocessor
from worker.proc import WAKE, WorkerArgs, WorkerProc
from worker.prompt_segments import PromptSegments

Send = Callable[[bytes], None]

# a Control whose args hold a list nested 100,000 deep: msgspec raises RecursionError
TOO_DEEP = b"\x94\xa3ctl\x01\xa5stats\x81\xa1a" + b"\x91" * 100_000 + b"\xc0"


@contextlib.contextmanager
def input_thread(tmp_path: Path, preprocess: Any) -> Iterator[tuple[WorkerProc, Send]]:
    """A worker's input thread on a real ZeroMQ socket, and a way to send it frames (the
    first waits until the worker's DEALER is connected: ROUTER_MANDATORY)."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.bind(f"ipc://{tmp_path}/in.sock")
    args = WorkerArgs(
        "w1", f"ipc://{tmp_path}/in.sock", f"ipc://{tmp_path}/out.sock", ModelConfig("m", "m")
    )
    proc = WorkerProc(args)
    thread = threading.Thread(target=proc._input_loop, args=(preprocess,), daemon=True)
    thread.start()

    def send(frame: bytes) -> None:
        deadline = time.monotonic() + 10
        while True:
            try:
                router.send_multipart([b"w1", frame])
                return
            except zmq.ZMQError:
                assert time.monotonic() < deadline
                time.sleep(0.01)

    try:
        yield proc, send
        assert thread.is_alive()
    finally:
        proc.stopping.set()
        thread.join(timeout=5)
        proc.channels.close()
        router.close()
        context.term()


def test_an_undecodable_frame_never_deafens_the_worker(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A RecursionError once escaped the decode, ended the input thread without a word and
    left a worker that beat its heart but heard nothing, a Shutdown included."""
    with input_thread(tmp_path, None) as (proc, send):
        send(TOO_DEEP)
        send(b"\xc1")
        send(Codec().encode(Abort(["r1"])))
        assert proc.inputs.get(timeout=10) == Abort(["r1"])
    dropped = [r.getMessage() for r in caplog.records if "undecodable frame" in r.getMessage()]
    assert len(dropped) == 2 and "maximum recursion depth" in dropped[0]


def test_a_grammar_compiled_off_the_input_thread_wakes_the_engine(
    tmp_path: Path, hermes_model_dir: Path
) -> None:
    """The engine waits on its inputs while its only requests wait on their grammars: the
    compile's end must put something there, or they would start a heartbeat late."""
    args = WorkerArgs(
        "w1", f"ipc://{tmp_path}/in.sock", f"ipc://{tmp_path}/out.sock", ModelConfig("m", "m")
    )
    proc = WorkerProc(args)
    try:
        proc._adopt(Preprocessor(load_tokenizer(hermes_model_dir), EngineOptions(), 4096))
        fmt = ResponseFormat(OutputFormat.JSON_SCHEMA, {"type": "object"}, strict=True)
        request = CanonicalRequest(messages=[Message("user", "Hi")], response_format=fmt)
        prepared = proc.preprocess(Add("r1", RequestKind.CHAT, request, SamplingParams()))
        assert prepared.guide.compiling is not None  # not compiled on this thread
        assert proc.inputs.get(timeout=60) is WAKE
        assert prepared.guide.ready() and prepared.guide.matcher is not None
    finally:
        proc.channels.close()


def test_the_input_thread_checks_a_prompts_segments_after_queueing_it(
    tmp_path: Path, hermes_model_dir: Path
) -> None:
    """A fresh worker's first prompts reach the engine with their segments' ids; the input
    thread encodes them whole after (here a fault makes the two differ: segments go off)."""
    tokenizer = load_tokenizer(hermes_model_dir)
    preprocess = Preprocessor(tokenizer, EngineOptions(), 4096)
    assert preprocess.segments is not None
    preprocess.segments = PromptSegments(preprocess.segments.tokens, user_turns_gain(tokenizer))
    queued = threading.Event()
    render = preprocess._render

    def whole_after_queueing(*args: object, **kwargs: object) -> object:
        assert queued.wait(10), "the prompt was encoded whole before it was queued"
        return render(*args, **kwargs)

    preprocess._render = whole_after_queueing  # type: ignore[method-assign]
    with input_thread(tmp_path, preprocess) as (proc, send):
        request = CanonicalRequest(messages=[Message("user", "Hi")])
        send(Codec().encode(Add("r1", RequestKind.CHAT, request, SamplingParams())))
        prepared = proc.inputs.get(timeout=30)
        queued.set()
        assert 7 in prepared.prompt  # its segments' ids
        deadline = time.monotonic() + 10
        while preprocess.segments.on:
            assert time.monotonic() < deadline, "the input thread did not check the prompt"
            time.sleep(0.01)
        assert "r1" in (preprocess.segments.off_reason or "")
