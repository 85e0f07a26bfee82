"""Shared fixtures: tiny real MLX models built once per session, and real gateways."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks._launch import AS_WORKER
from shared.blas import CACHE_THRASHING_CHECK, CUDNN_SDPA, PTX_CACHE
from tests.engine_fixtures import PROMPT_TEXTS, Loaded, load
from tests.gateway_proc import GatewayProc, running_gateway
from worker.modelgen import TinyModelSpec, build_tiny_model, byte_token_id
from worker.vision.modelgen import TinyVisionSpec, build_tiny_vision_model

# Greedy-equality model: a large logit scale makes argmax margins far wider than the last-bit
# differences between batched and single-sequence matmuls.
CHAT_SPEC = TinyModelSpec(hidden_size=64, num_layers=2, vocab_size=512, logit_scale=8.0, seed=1)
# A second, different model for the two-worker tests.
OTHER_SPEC = TinyModelSpec(hidden_size=48, num_layers=1, vocab_size=384, logit_scale=4.0, seed=2)
# Tool calling and thinking, in each tool-call format mlx-lm parses (worker/chat_templates.py).
HERMES_SPEC = TinyModelSpec(logit_scale=8.0, seed=3, tool_format="hermes", thinking=True)
CODER_SPEC = TinyModelSpec(logit_scale=8.0, seed=4, tool_format="qwen3_coder", thinking=True)
# A Qwen2 (biased Q/K/V; mlx-lm can pipeline it), three layers for two or three ranks
QWEN2_SPEC = TinyModelSpec(
    hidden_size=64, num_layers=3, vocab_size=512, logit_scale=8.0, seed=5, model_type="qwen2"
)
# A Qwen2-VL (mlx-vlm): wide greedy margins, as CHAT_SPEC
VISION_SPEC = TinyVisionSpec(logit_scale=8.0)


def bytes_spec(model_dir: Path) -> TinyModelSpec:
    """Byte-level vocabulary and a scripted (bigram) greedy chain, for UTF-8 and stop tests:
    'a' -> C3 -> A9 -> C3 ... spells "ééé" one byte token at a time; 'x' -> 'y' -> 'z' -> 'x'."""
    probe = build_tiny_model(model_dir, TinyModelSpec(vocab_size=400, byte_fallback=True))
    b = {c: byte_token_id(probe, c) for c in (0x61, 0xC3, 0xA9, 0x78, 0x79, 0x7A)}
    chain = {b[0x61]: b[0xC3], b[0xC3]: b[0xA9], b[0xA9]: b[0xC3]}
    chain |= {b[0x78]: b[0x79], b[0x79]: b[0x7A], b[0x7A]: b[0x78]}
    return TinyModelSpec(
        hidden_size=64, num_layers=1, vocab_size=400, byte_fallback=True, bigram=chain
    )


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def chat_model(model_root: Path) -> Path:
    return build_tiny_model(model_root / "chat", CHAT_SPEC)


@pytest.fixture(scope="session")
def chat(chat_model: Path) -> Loaded:
    """CHAT_SPEC's model loaded in this process, for in-process engine tests."""
    return load(chat_model)


@pytest.fixture(scope="session")
def prompts(chat: Loaded) -> list[list[int]]:
    """PROMPT_TEXTS tokenized by the chat model: prompts of several shapes."""
    return [chat.tokenizer.encode(t) for t in PROMPT_TEXTS]


@pytest.fixture(scope="session")
def qwen2_model(model_root: Path) -> Path:
    return build_tiny_model(model_root / "qwen2", QWEN2_SPEC)


@pytest.fixture(scope="session")
def other_model(model_root: Path) -> Path:
    return build_tiny_model(model_root / "other", OTHER_SPEC)


@pytest.fixture(scope="session")
def bytes_model(model_root: Path) -> Path:
    path = model_root / "bytes"
    return build_tiny_model(path, bytes_spec(path))


@pytest.fixture(scope="session")
def hermes_model_dir(model_root: Path) -> Path:
    """Hermes/Qwen JSON tool calls (mlx-lm's json_tools) and <think> reasoning."""
    return build_tiny_model(model_root / "hermes", HERMES_SPEC)


@pytest.fixture(scope="session")
def coder_model_dir(model_root: Path) -> Path:
    """Qwen3-Coder XML tool calls (mlx-lm's qwen3_coder) and <think> reasoning."""
    return build_tiny_model(model_root / "coder", CODER_SPEC)


@pytest.fixture(scope="session")
def vision_model_dir(model_root: Path) -> Path:
    return build_tiny_vision_model(model_root / "vision", seed=5, spec=VISION_SPEC)


@pytest.fixture(scope="session")
def gateway(chat_model: Path, other_model: Path, bytes_model: Path) -> Iterator[GatewayProc]:
    """One gateway serving three models from three worker processes, for most e2e tests."""
    models = [
        {"name": "chat", "source": str(chat_model), "aliases": ["chat-alias"]},
        {"name": "other", "source": str(other_model), "engine": {"max_context": 256}},
        {"name": "bytes", "source": str(bytes_model)},
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


@pytest.fixture(params=["mlx_lm", "rows", "compiled"])
def batcher(request: pytest.FixtureRequest) -> Iterator[str]:
    """Engines built in the test use this continuous batch (engine.batcher; "compiled": the
    rows batch with the compiled decode step, engine.decode_step, and first tokens from the
    prefill, engine.first_token; "rows": with mlx-lm's forward pass and first tokens from
    the next step), unless the test names
    another; modules opt in with `pytestmark = pytest.mark.usefixtures("batcher")`."""
    from tests import engine_fixtures

    compiled = request.param == "compiled"
    engine_fixtures.ENGINE_DEFAULTS["batcher"] = "rows" if compiled else request.param
    engine_fixtures.ENGINE_DEFAULTS["decode_step"] = "compiled" if compiled else "model"
    if request.param != "mlx_lm":
        engine_fixtures.ENGINE_DEFAULTS["first_token"] = "prefill" if compiled else "step"
    try:
        yield request.param
    finally:
        for key in ("batcher", "decode_step", "first_token"):
            engine_fixtures.ENGINE_DEFAULTS.pop(key, None)


@pytest.fixture(autouse=True)
def benchmarks_run_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    """A benchmark's `main` called by a test runs in pytest's own process: it does not
    re-execute itself under a worker's environment (benchmarks/_launch.py, `as_worker`)."""
    monkeypatch.setenv(AS_WORKER, "1")


@pytest.fixture
def no_mlx_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The MLX settings a worker puts in its environment (shared.blas.mlx_worker_defaults)
    unset for the test, and the environment as it was after, whatever the test set."""
    for name in (CUDNN_SDPA, CACHE_THRASHING_CHECK, PTX_CACHE):
        monkeypatch.setenv(name, "")  # recorded, so that a value set later goes again
        monkeypatch.delenv(name)
