"""Control calls from the gateway, answered on the worker's input thread, beside the engine
loop (never inside it): stats, tokenize, detokenize."""

from __future__ import annotations

from typing import Any

import msgspec

from shared.protocol import Control, ControlReply
from worker.preprocess import PreprocessError


def answer(worker_id: str, engine: Any, frame: Control, preprocess: Any) -> ControlReply:
    """Calls answered on the input thread, beside the engine loop (never inside it)."""
    try:
        if frame.method == "stats" and engine is not None:
            running, waiting = engine.counts()
            steps = getattr(engine, "steps", 0)
            result = {"running": running, "waiting": waiting, "steps": steps}
        elif frame.method == "tokenize" and hasattr(preprocess, "tokenize_call"):
            result = preprocess.tokenize_call(frame.args)
        elif frame.method == "detokenize" and hasattr(preprocess, "detokenize_call"):
            result = preprocess.detokenize_call(frame.args)
        else:
            return ControlReply(
                worker_id, frame.call_id, False, error=f"unknown method {frame.method}"
            )
    except PreprocessError as exc:
        return ControlReply(
            worker_id,
            frame.call_id,
            False,
            {"code": exc.error.code.value, "param": exc.error.param},
            exc.error.message,
        )
    try:
        msgspec.msgpack.encode(result)
    except (TypeError, ValueError, OverflowError) as exc:  # never let a reply kill a thread
        return ControlReply(
            worker_id, frame.call_id, False, error=f"{frame.method}: unencodable: {exc}"
        )
    return ControlReply(worker_id, frame.call_id, True, result)
