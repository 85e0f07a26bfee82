"""The engine's backend for vision models, on mlx-vlm's public API: the model, its image
processor and the images' prefill; decoding is the text backend's own continuous batch.

A vision model is a vision tower and a language model. A prompt with images is prefilled
here, on its own: the processor expands each image's placeholder into its image tokens,
`get_input_embeddings` runs the vision tower and puts the images' features in those tokens'
places, and the language model fills a KV cache from those embeddings (only the part a
cached prefix does not already hold). The row then joins the running batch with its KV, as
a cached prefix would, and decodes beside text rows and other images' rows: after its
prompt, a row's next input is a token like any other.

mRoPE models (the Qwen-VL family) give image tokens two-dimensional positions, so a prompt's
text after an image sits at a position shifted from its index (its `rope_deltas`). The
batch carries each row's shift and `VisionModel` turns cache offsets plus shifts into the
model's position ids at every step: nothing rests on the language model's own remembered
state, which belongs to one prompt at a time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.utils import load_tokenizer

from shared.config import EngineOptions
from worker.backends.mlx_lm import MlxRowsBackend, cache_kinds

# what get_input_embeddings may return that this backend passes on (positions it computes
# itself); anything else is a per-prompt input of the language model it does not serve yet
KNOWN_FEATURES = frozenset({"inputs_embeds", "position_ids", "rope_deltas"})


@dataclass(slots=True)
class Media:
    """A prompt's images as the model takes them: the processor's arrays (pixel values, grid
    sizes...), made on the input thread; the vision tower runs at prefill."""

    pixel_values: Any
    extra: dict[str, Any] = field(default_factory=dict)  # image_grid_thw and the like
    count: int = 0  # images


def load(path: Path, trust_remote_code: bool = False) -> tuple[VisionModel, Any, Any]:
    """(model, tokenizer, processor): the tokenizer as mlx-lm wraps it (streaming
    detokenizer, eos ids, chat template), the processor mlx-vlm's."""
    import mlx_vlm

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder: nothing to fetch
    model, processor = mlx_vlm.load(str(path), trust_remote_code=trust_remote_code)
    tokenizer = load_tokenizer(path)
    return VisionModel(model), tokenizer, processor


def qwen2_vl_parameter_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Names and shapes of mlx-vlm's Qwen2-VL parameters for a config.json's contents, from
    its own model as load() makes it (the arrays stay lazy): the test models' generator."""
    import copy

    from mlx.utils import tree_flatten
    from mlx_vlm.models.qwen2_vl import Model, ModelConfig, TextConfig, VisionConfig

    model_config = ModelConfig.from_dict(copy.deepcopy(config))
    model_config.text_config = TextConfig.from_dict(model_config.text_config)
    model_config.vision_config = VisionConfig.from_dict(model_config.vision_config)
    params: dict[str, Any] = dict(tree_flatten(Model(model_config).parameters()))
    return {name: tuple(params[name].shape) for name in sorted(params)}


def prepare(processor: Any, text: str, images: list[Any]) -> tuple[list[int], Media]:
    """The rendered prompt and its PIL images through the model's processor: token ids
    with each image's placeholder expanded, and the images' arrays."""
    from mlx_vlm import prepare_inputs

    inputs = prepare_inputs(processor, images=images, prompts=text)
    ids = inputs.pop("input_ids")
    inputs.pop("attention_mask", None)
    pixels = inputs.pop("pixel_values", None)
    extra = {k: v for k, v in inputs.items() if v is not None}
    return [int(t) for t in ids.reshape(-1).tolist()], Media(pixels, extra, len(images))


class VisionModel:
    """mlx-vlm's model as the batch sees a language model: `model(tokens, cache=...)` gives
    logits, `layers` its layers (for the KV cache). For mRoPE models it passes the position
    ids itself: each row's cache offset, plus its `shifts` entry."""

    def __init__(self, model: Any) -> None:
        self.vlm = model
        self.lm = model.language_model
        self.mrope = hasattr(self.lm, "get_rope_index")
        self.model_type = str(getattr(model.config, "model_type", "?"))
        config = model.config
        self.image_token = getattr(config, "image_token_id", None)
        if self.image_token is None:
            self.image_token = getattr(config, "image_token_index", None)

    @property
    def layers(self) -> Any:
        return self.lm.layers

    def make_cache(self) -> list[Any]:
        if hasattr(self.lm, "make_cache"):
            return list(self.lm.make_cache())
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in self.lm.layers]

    def __call__(self, inputs: mx.array, cache: Any = None, shifts: Any = None) -> mx.array:
        if not self.mrope:
            if shifts is not None:
                raise ValueError("only mRoPE models shift positions")
            return self.lm(inputs, cache=cache).logits
        positions = self.positions(inputs.shape, cache, shifts)
        return self.lm(inputs, cache=cache, position_ids=positions).logits

    @staticmethod
    def positions(shape: tuple[int, ...], cache: Any, shifts: Any) -> mx.array:
        """(3, rows, length) mRoPE positions after each row's cached tokens: text positions
        are the same on all three axes."""
        rows, length = shape
        offset = cache[0].offset if cache else 0
        if isinstance(offset, mx.array):
            start = offset.reshape(-1, 1).astype(mx.int32)
        else:
            start = mx.full((rows, 1), int(offset), dtype=mx.int32)
        if shifts is not None:
            start = start + shifts.reshape(-1, 1).astype(mx.int32)
        pos = start + mx.arange(length, dtype=mx.int32)[None]
        return mx.broadcast_to(pos[None], (3, rows, length))


class VisionRowsBackend(MlxRowsBackend):
    """The rows batch over a vision model's language model, with prompts that hold images
    prefilled here first (see the module's docstring)."""

    batcher = "rows"

    def __init__(
        self, model: VisionModel, tokenizer: Any, processor: Any, options: EngineOptions
    ) -> None:
        kinds = cache_kinds(model)
        if kinds != {"KVCache"}:
            raise ValueError(
                f"vision models are served on the rows batch, which needs a plain KV cache in "
                f"every layer; {model.model_type}'s language model uses "
                f"{', '.join(sorted(kinds))} (kind = 'llm' serves its text through mlx-lm, "
                "where mlx-lm knows the family)"
            )
        super().__init__(model, tokenizer, options)
        self.processor = processor
        self.vision: VisionModel = model

    def prefill(self, prompt: list[int], media: Media, cache: Any, cached: int) -> tuple[Any, int]:
        """KV for all of `prompt` but its last token, after the `cached` tokens `cache`
        already holds (a fresh cache when None); and the row's position shift."""
        model = self.vision
        ids = mx.array(prompt)[None]
        end = len(prompt) - 1
        positions, shift = None, 0
        if model.mrope:
            positions, deltas = model.lm.get_rope_index(
                ids, media.extra.get("image_grid_thw"), None, mx.ones_like(ids)
            )
            shift = int(deltas.reshape(-1)[0].item())
        cache = cache if cache is not None else self.new_cache()
        if cached >= end:
            return cache, shift
        embeds = None
        if model.image_token in prompt[cached:end]:  # the vision tower is needed
            features = model.vlm.get_input_embeddings(
                ids, media.pixel_values, mask=mx.ones_like(ids), **media.extra
            )
            unknown = [
                k
                for k, v in features.to_dict().items()
                if v is not None and k not in KNOWN_FEATURES
            ]
            if unknown:
                raise ValueError(
                    f"{model.model_type} passes {', '.join(sorted(unknown))} to its language "
                    "model with the images: not served yet"
                )
            embeds = features.inputs_embeds
        for start in range(cached, end, self.prefill_step_size):
            stop = min(start + self.prefill_step_size, end)
            kwargs: dict[str, Any] = {}
            if positions is not None:
                kwargs["position_ids"] = positions[:, :, start:stop]
            if embeds is not None:
                kwargs["inputs_embeds"] = embeds[:, start:stop]
            model.lm(ids[:, start:stop], cache=cache, **kwargs)
            mx.eval([c.state for c in cache])
        return cache, shift
