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
from worker.preprocess import Preprocessor
from worker.proc import WAKE, WorkerArgs, WorkerProc

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
