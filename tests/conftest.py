"""Shared fixtures: tiny real MLX models built once per session, and real gateways."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gateway_proc import GatewayProc, running_gateway
from worker.modelgen import TinyModelSpec, build_tiny_model

# Greedy-equality model: a large logit scale makes argmax margins far wider than the last-bit
# differences between batched and single-sequence matmuls.
CHAT_SPEC = TinyModelSpec(hidden_size=64, num_layers=2, vocab_size=512, logit_scale=8.0, seed=1)
# A second, different model for the two-worker tests.
OTHER_SPEC = TinyModelSpec(hidden_size=48, num_layers=1, vocab_size=384, logit_scale=4.0, seed=2)
# Byte-level vocabulary, for UTF-8 tests.
BYTES_SPEC = TinyModelSpec(hidden_size=64, num_layers=1, vocab_size=400, byte_fallback=True)


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def chat_model(model_root: Path) -> Path:
    return build_tiny_model(model_root / "chat", CHAT_SPEC)


@pytest.fixture(scope="session")
def other_model(model_root: Path) -> Path:
    return build_tiny_model(model_root / "other", OTHER_SPEC)


@pytest.fixture(scope="session")
def gateway(chat_model: Path, other_model: Path) -> Iterator[GatewayProc]:
    """One gateway serving two models from two worker processes, for most e2e tests."""
    models = [
        {"name": "chat", "source": str(chat_model), "aliases": ["chat-alias"]},
        {"name": "other", "source": str(other_model), "engine": {"max_context": 256}},
    ]
    with running_gateway(models, request_timeout_s=60.0) as gw:
        yield gw


@pytest.fixture(scope="session")
def client(gateway: GatewayProc):  # type: ignore[no-untyped-def]
    import openai

    return openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


__all__ = ["GatewayProc"]
