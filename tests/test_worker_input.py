"""The worker's input thread over a real ZeroMQ socket: a frame it cannot decode is logged
and dropped, and the frames after it still reach the engine's queue; what is made off that
thread (a grammar) wakes the engine."""

from __future__ import annotations

import threading
import time
from pathlib import Path

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
from tests.test_prompt_segments import encoder
from worker.preprocess import Preprocessor
from worker.proc import WAKE, WorkerArgs, WorkerProc
from worker.prompt_segments import PromptSegments

# a Control whose args hold a list nested 100,000 deep: msgspec raises RecursionError
TOO_DEEP = b"\x94\xa3ctl\x01\xa5stats\x81\xa1a" + b"\x91" * 100_000 + b"\xc0"


def test_an_undecodable_frame_never_deafens_the_worker(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A RecursionError once escaped the decode, ended the input thread without a word and
    left a worker that beat its heart but heard nothing, a Shutdown included."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.bind(f"ipc://{tmp_path}/in.sock")
    args = WorkerArgs(
        "w1", f"ipc://{tmp_path}/in.sock", f"ipc://{tmp_path}/out.sock", ModelConfig("m", "m")
    )
    proc = WorkerProc(args)
    thread = threading.Thread(target=proc._input_loop, args=(None,), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while True:  # until the worker's DEALER is connected (ROUTER_MANDATORY)
            try:
                router.send_multipart([b"w1", TOO_DEEP])
                break
            except zmq.ZMQError:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        router.send_multipart([b"w1", b"\xc1"])
        router.send_multipart([b"w1", Codec().encode(Abort(["r1"]))])
        assert proc.inputs.get(timeout=10) == Abort(["r1"])
        assert thread.is_alive()
    finally:
        proc.stopping.set()
        thread.join(timeout=5)
        proc.channels.close()
        router.close()
        context.term()
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
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.bind(f"ipc://{tmp_path}/in.sock")
    args = WorkerArgs(
        "w1", f"ipc://{tmp_path}/in.sock", f"ipc://{tmp_path}/out.sock", ModelConfig("m", "m")
    )
    proc = WorkerProc(args)
    tokenizer = load_tokenizer(hermes_model_dir)
    preprocess = Preprocessor(tokenizer, EngineOptions(), 4096)
    assert preprocess.segments is not None
    encode = encoder(tokenizer)
    queued = threading.Event()

    def erring(texts: list[str]) -> list[list[int]]:  # a user turn gains a token
        return [
            [*ids, 7] if t.startswith("<|im_start|>user") else ids
            for t, ids in zip(texts, encode(texts), strict=True)
        ]

    def whole_after_queueing(*args: object, **kwargs: object) -> object:
        assert queued.wait(10), "the prompt was encoded whole before it was queued"
        return render(*args, **kwargs)

    preprocess.segments = PromptSegments(preprocess.segments.tokens, erring)
    render = preprocess._render
    preprocess._render = whole_after_queueing  # type: ignore[method-assign]
    thread = threading.Thread(target=proc._input_loop, args=(preprocess,), daemon=True)
    thread.start()
    try:
        request = CanonicalRequest(messages=[Message("user", "Hi")])
        frame = Codec().encode(Add("r1", RequestKind.CHAT, request, SamplingParams()))
        deadline = time.monotonic() + 10
        while True:  # until the worker's DEALER is connected (ROUTER_MANDATORY)
            try:
                router.send_multipart([b"w1", frame])
                break
            except zmq.ZMQError:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        prepared = proc.inputs.get(timeout=30)
        queued.set()
        assert 7 in prepared.prompt  # its segments' ids
        deadline = time.monotonic() + 10
        while preprocess.segments.on:
            assert time.monotonic() < deadline, "the input thread did not check the prompt"
            time.sleep(0.01)
        assert "r1" in (preprocess.segments.off_reason or "")
    finally:
        proc.stopping.set()
        thread.join(timeout=5)
        proc.channels.close()
        router.close()
        context.term()
