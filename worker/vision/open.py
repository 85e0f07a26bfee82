"""A vision model's worker parts: the model (mlx-vlm), its backend and its preprocessor, and
the image request Ready waits for."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from shared.config import ModelConfig
from shared.modelinfo import context_length
from shared.protocol import Add
from shared.types import (
    CanonicalRequest,
    ImagePart,
    Message,
    RequestKind,
    SamplingParams,
    TextPart,
)
from worker.backends.formats import ModelFormats
from worker.loader import LoadedModel, LoadError, Progress
from worker.preprocess import PreparedRequest
from worker.vision.prompt import VisionPreprocessor


def open_vision(config: ModelConfig, path: Path, progress: Progress) -> tuple[LoadedModel, Any]:
    """(the model as the engine takes it, its processor)."""
    from worker.backends.mlx_vlm import load

    progress("loading weights", -1.0)
    try:
        model, tokenizer, processor = load(path, trust_remote_code=config.trust_remote_code)
    except Exception as exc:
        raise LoadError(f"model {config.name!r}: mlx-vlm could not load {path}: {exc}") from exc
    return LoadedModel(
        model, tokenizer, path, context_length(path, config), config.is_demo
    ), processor


def vision_backend(loaded: LoadedModel, processor: Any, config: ModelConfig) -> Any:
    from worker.backends.mlx_vlm import VisionRowsBackend

    if config.engine.batcher == "mlx_lm":
        raise LoadError(
            f"model {config.name!r}: vision models run on the rows batch (engine.batcher = "
            "'auto' or 'rows'), which carries each row's image positions"
        )
    return VisionRowsBackend(loaded.model, loaded.tokenizer, processor, config.engine)


def vision_preprocessor(
    loaded: LoadedModel, processor: Any, config: ModelConfig, formats: ModelFormats
) -> VisionPreprocessor:
    return VisionPreprocessor(
        loaded.tokenizer,
        processor,
        loaded.model.image_token,
        config.engine,
        loaded.max_context,
        formats,
    )


def probe_request(preprocess: VisionPreprocessor) -> PreparedRequest:
    """One greedy token from a prompt with a small image: its vision tower, its image
    tokens' positions and its KV through the batch."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(buffer, format="PNG")
    image = ImagePart(buffer.getvalue(), media_type="image/png", where="probe")
    message = Message("user", "What is this?", parts=[image, TextPart("What is this?")])
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    frame = Add("__probe__", RequestKind.CHAT, CanonicalRequest(messages=[message]), sampling)
    return preprocess(frame)
