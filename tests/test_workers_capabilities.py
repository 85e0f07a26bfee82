"""gateway/workers/capabilities.py: a model's chat-template defaults under a request's, and
what it can serve, known from its last Ready or, before one, from its files."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.errors import GatewayError
from gateway.workers.capabilities import check_capabilities, with_template_defaults
from gateway.workers.slots import Slot
from shared.config import ModelConfig
from shared.protocol import Capacity, Ready
from shared.types import CanonicalRequest, Message, RequestKind

MODEL = ModelConfig(name="m", source="/nowhere", chat_template_kwargs={"enable_thinking": False})


def test_the_requests_template_variables_win_key_by_key() -> None:
    request = CanonicalRequest(
        messages=[Message("user", "hi")], chat_template_kwargs={"enable_thinking": True, "a": 1}
    )
    merged = with_template_defaults(MODEL, RequestKind.CHAT, request)
    assert merged.chat_template_kwargs == {"enable_thinking": True, "a": 1}
    plain = with_template_defaults(MODEL, RequestKind.CHAT, CanonicalRequest(messages=[]))
    assert plain.chat_template_kwargs == {"enable_thinking": False}
    completion = CanonicalRequest(prompt="x")
    assert with_template_defaults(MODEL, RequestKind.COMPLETION, completion) is completion


def test_the_last_ready_says_what_the_model_serves() -> None:
    slot = Slot(MODEL)
    slot.last_info = Ready("w", Capacity(1, 1, 64), capabilities=["completion"])
    check_capabilities(slot, ["completion"])
    with pytest.raises(GatewayError) as err:
        check_capabilities(slot, ["completion", "chat"])
    assert err.value.param == "messages" and "no chat template" in err.value.message


def test_before_a_ready_the_files_say_and_unknown_files_check_nothing(tmp_path: Path) -> None:
    unknown = Slot(MODEL)  # a hub id not downloaded yet: nothing known, nothing refused
    check_capabilities(unknown, ["chat", "logprobs"])
    assert unknown.peeked == []
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 512}')
    (tmp_path / "tokenizer_config.json").write_text("{}")  # no chat template
    local = Slot(ModelConfig(name="base", source=str(tmp_path)))
    check_capabilities(local, ["completion", "logprobs", "echo"])
    with pytest.raises(GatewayError, match="no chat template"):
        check_capabilities(local, ["chat"])
    assert local.peeked is not None and "chat" not in local.peeked
