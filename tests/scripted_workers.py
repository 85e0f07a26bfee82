"""The gateway's real app (its middleware, routes and translators) in process, in front of a
scripted stand-in for the workers that answers each request as its model's kind of worker
would: the fuzz tests' target (tests/test_fuzz_http.py, tests/test_fuzz_openapi.py). And a
stream that hands a reader a worker's outputs one at a time (tests/test_audio_routes.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.app import GatewayApp, create_app
from gateway.errors import GatewayError
from gateway.workers.capabilities import check_capabilities
from gateway.workers.client import ModelState, ModelView, RequestStream, Submission
from gateway.workers.slots import Slot
from shared.config import Config, ModelConfig, ServerConfig
from shared.protocol import Capacity, Ready
from shared.types import (
    CanonicalRequest,
    ErrorCode,
    FinishReason,
    RequestKind,
    RequestOutput,
    Usage,
)

MODELS = {
    "text": ["chat", "completion", "logprobs", "echo", "tokenize", "structured_output", "tools"],
    "embed": ["embeddings", "rerank"],
    "tts": ["speech"],
}
# What a model named by no one else serves: everything but images (which would be fetched)
EVERYTHING = [
    *MODELS["text"],
    *MODELS["embed"],
    *MODELS["tts"],
    "reasoning",
    "audio_input",
    "transcription",
    "translation",
]


class Workers:
    """Answers every request as a worker of its model's kind would (one token of text,
    vectors, scores or audio), after the capability checks the supervisor makes. A name not
    in MODELS is a 404, or with `any_name` a model that serves everything."""

    def __init__(self, any_name: bool = False) -> None:
        self.any_name = any_name
        self.draining = False

    @property
    def models(self) -> dict[str, ModelConfig]:
        return {name: ModelConfig(name=name, source="/nowhere") for name in MODELS}

    def capabilities(self, name: str) -> list[str]:
        return MODELS.get(name, EVERYTHING)

    def resolve(self, name: str) -> ModelConfig:
        if name not in MODELS and not self.any_name:
            raise GatewayError(ErrorCode.MODEL_NOT_FOUND, f"no model {name!r}", "model")
        return ModelConfig(name=name, source="/nowhere")

    def must_load(self, name: str) -> bool:
        return False

    def view(self, name: str) -> ModelView:
        info = Ready("w", Capacity(4, 4, 4096), capabilities=self.capabilities(name))
        config = self.resolve(name)
        return ModelView(
            config,
            ModelState.READY,
            in_flight=0,
            restarts=0,
            heartbeat=None,
            info=info,
            last_info=info,
        )

    def views(self) -> list[ModelView]:
        return [self.view(name) for name in MODELS]

    def check(self, name: str, needs: Sequence[str]) -> None:
        slot = Slot(self.resolve(name))
        slot.last_info = Ready("w", Capacity(4, 4, 4096), capabilities=self.capabilities(name))
        check_capabilities(slot, list(needs))

    async def submit(self, submission: Submission) -> RequestStream:
        self.check(submission.model, submission.needs)
        stream = RequestStream(submission.request_id or "r", submission.model, "w")
        rid, request = stream.request_id, submission.request
        end = RequestOutput(rid, finish_reason=FinishReason.STOP, usage=Usage(3, 1))
        if submission.kind in (RequestKind.CHAT, RequestKind.COMPLETION):
            end.text, end.token_ids = "ok", [1]
        elif submission.kind == RequestKind.EMBEDDING:
            count = len(request.inputs) or len(request.input_token_ids)
            end.embeddings, end.dimensions = bytes(8 * count), 2
        elif submission.kind == RequestKind.RERANK:
            end.scores = [0.5] * len(request.documents)
        elif submission.kind == RequestKind.SPEECH:
            end.audio, end.duration = b"\x00\x01", 0.1
        else:  # a transcription or translation
            end.text, end.duration = "ok", 0.1
        asyncio.get_running_loop().call_soon(stream.put, end)
        return stream

    def abort(self, stream: RequestStream) -> None:
        pass

    async def call(self, name: str, method: str, args: dict[str, Any], **_: Any) -> Any:
        return {"text": "ok"}

    async def tokenize(
        self, name: str, kind: RequestKind, request: CanonicalRequest, with_text: bool = False
    ) -> dict[str, Any]:
        self.check(name, ["tokenize"])
        tokens = {"tokens": [1, 2], "count": 2, "max_context": 4096}
        return tokens | ({"token_strs": ["o", "k"]} if with_text else {})


def scripted_app(folder: Path, any_name: bool = False, **server: Any) -> GatewayApp:
    """The app as `gatewayctl serve` builds it (no keys: open), its workers scripted; its
    lifespan is not run (no supervisor, admin socket or mDNS). `server`: more settings."""
    settings = {"keys_file": str(folder / "keys.json"), "run_dir": str(folder), **server}
    app = create_app(Config(server=ServerConfig(**settings)))  # type: ignore[arg-type]
    app.state.workers = Workers(any_name)
    return app


class PacedStream(RequestStream):
    """A worker's outputs one at a time: the next is sent once the reader took the one before,
    so that none merge (an error after audio stays after it, however slow the machine)."""

    def __init__(self, request_id: str, model: str, outputs: list[RequestOutput]) -> None:
        super().__init__(request_id, model, "w")
        self.outputs = list(outputs)

    def feed(self) -> None:
        if self.outputs:
            self.put(self.outputs.pop(0))

    async def get(self) -> RequestOutput:
        output = await super().get()
        asyncio.get_running_loop().call_later(0.001, self.feed)
        return output
