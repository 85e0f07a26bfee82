"""Tiny random-weight Qwen2-VL models that `mlx_vlm.load` loads offline, for tests and demos.

Everything is generated offline: a byte-level BPE tokenizer over printable characters only
(trained on worker/corpus.py's text, as in worker/modelgen.py) with Qwen2-VL's special tokens
first, random weights in the layout of `mlx_vlm.models.qwen2_vl`, the real Qwen2-VL-Instruct
chat template and a Qwen2-VL image processor config whose small pixel bounds make an image
4 to 16 image tokens. The weights are random, so the text is gibberish, but printable.
`mlx_lm.load` of the folder is not supported (the text model is mlx-vlm's).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.corpus import builtin_corpus
from worker.engine.tokens import byte_to_unicode
from worker.modelgen import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    _printable_bytes,
    _printable_only,
    _write_json,
    count_parameters,
    is_printable_text,
)

if TYPE_CHECKING:
    import mlx.core as mx
    from tokenizers import Tokenizer

# Qwen2-VL's special tokens in Qwen's order (ids 151643.. there, 0.. here: the BPE trainer
# numbers special tokens first). The names matter: mlx-vlm's processor expands <|image_pad|>,
# and the model finds an image's positions from <|vision_start|>.
SPECIAL_TOKENS = (
    ENDOFTEXT,
    IM_START,
    IM_END,
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
TOKEN_IDS = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
ENDOFTEXT_ID = TOKEN_IDS[ENDOFTEXT]  # 0: pad
IM_END_ID = TOKEN_IDS[IM_END]  # 2: eos (non-zero, as worker/modelgen.py needs)
VISION_START_ID = TOKEN_IDS["<|vision_start|>"]
VISION_END_ID = TOKEN_IDS["<|vision_end|>"]
VISION_PAD_ID = TOKEN_IDS["<|vision_pad|>"]
IMAGE_PAD = "<|image_pad|>"
IMAGE_PAD_ID = TOKEN_IDS[IMAGE_PAD]
VIDEO_PAD_ID = TOKEN_IDS["<|video_pad|>"]

# The real Qwen2-VL-Instruct chat template (chat_template.json of Qwen/Qwen2-VL-2B-Instruct).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

PATCH_SIZE = 14
TEMPORAL_PATCH_SIZE = 2
MERGE_SIZE = 2
# One image token is a MERGE_SIZE x MERGE_SIZE block of patches: 28 x 28 pixels.
TOKEN_PIXELS = PATCH_SIZE * MERGE_SIZE
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)

RANDOM_WEIGHTS_COMMENT = (
    "Test model with random weights (mlx-gateway worker.vision.modelgen): gibberish."
)
RMS_NORM_EPS = 1e-6
ROPE_THETA = 10000.0

MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
    "chat_template.json",
)


@dataclass(frozen=True, slots=True)
class TinyVisionSpec:
    """Shape of a generated model. `vocab_size` is the BPE training target (specials included).

    `min_pixels`/`max_pixels` bound an image's area after resizing, as in Qwen2-VL's image
    processor: the defaults (56*56 .. 112*112) make every image 4 to 16 image tokens.
    """

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    vision_embed_dim: int = 32
    vision_depth: int = 1
    vision_heads: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 112 * 112
    logit_scale: float = 1.0


DEFAULT_VISION_SPEC = TinyVisionSpec()


def mrope_section(spec: TinyVisionSpec) -> list[int]:
    """Temporal, height and width shares of the rotary half-dims (Qwen2-VL's 16:24:24)."""
    half = spec.hidden_size // spec.num_heads // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def image_tokens(width: int, height: int, spec: TinyVisionSpec = DEFAULT_VISION_SPEC) -> int:
    """How many <|image_pad|> tokens an image of this size becomes (Qwen2-VL's smart_resize)."""
    if min(width, height) < 1 or max(width, height) / min(width, height) > 200:
        raise ValueError(f"image too small or too narrow: {width}x{height}")
    f = TOKEN_PIXELS
    h, w = round(height / f) * f, round(width / f) * f
    if h * w > spec.max_pixels:
        beta = math.sqrt(height * width / spec.max_pixels)
        h = max(f, math.floor(height / beta / f) * f)
        w = max(f, math.floor(width / beta / f) * f)
    elif h * w < spec.min_pixels:
        beta = math.sqrt(spec.min_pixels / (height * width))
        h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
    return (h // f) * (w // f)


# --- tokenizer ---------------------------------------------------------------------------------


def _train_tokenizer(spec: TinyVisionSpec, corpus: str | None) -> Tokenizer:
    """Byte-level BPE over printable bytes only, so that any token sequence decodes to text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    text = corpus if corpus is not None else builtin_corpus(max(8000, spec.vocab_size * 30))
    table = byte_to_unicode()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=[table[b] for b in _printable_bytes()],
        show_progress=False,
    )
    tokenizer.train_from_iterator([_printable_only(text)], trainer)
    _check_vocab(tokenizer)
    return tokenizer


def _check_vocab(tokenizer: Tokenizer) -> None:
    for token, want in TOKEN_IDS.items():
        if tokenizer.token_to_id(token) != want:
            raise RuntimeError(f"special token {token} did not get id {want}")
    for i in range(len(SPECIAL_TOKENS), tokenizer.get_vocab_size()):
        text = tokenizer.decode([i])
        if not is_printable_text(text):
            raise RuntimeError(f"token {i} decodes to non-printable {text!r}")


def _tokenizer_config(spec: TinyVisionSpec) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }


def _special_tokens_map() -> dict[str, Any]:
    return {
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
    }


def _image_processor_config(spec: TinyVisionSpec) -> dict[str, Any]:
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
        "patch_size": PATCH_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "merge_size": MERGE_SIZE,
        "min_pixels": spec.min_pixels,
        "max_pixels": spec.max_pixels,
        "size": {"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
        "image_mean": list(IMAGE_MEAN),
        "image_std": list(IMAGE_STD),
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
    }


# --- weights -----------------------------------------------------------------------------------


def _model_config(spec: TinyVisionSpec, seed: int, vocab_size: int) -> dict[str, Any]:
    # mlx-vlm's ModelConfig.from_dict copies the root keys into text_config.
    return {
        "_comment": RANDOM_WEIGHTS_COMMENT,
        "mlx_gateway_spec": {**asdict(spec), "seed": seed},
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "intermediate_size": spec.intermediate_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_theta": ROPE_THETA,
        "rope_scaling": {"type": "mrope", "mrope_section": mrope_section(spec)},
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": IM_END_ID,
        "pad_token_id": ENDOFTEXT_ID,
        "vision_start_token_id": VISION_START_ID,
        "vision_end_token_id": VISION_END_ID,
        "vision_token_id": VISION_PAD_ID,
        "image_token_id": IMAGE_PAD_ID,
        "video_token_id": VIDEO_PAD_ID,
        "vision_config": {
            "model_type": "qwen2_vl",
            "depth": spec.vision_depth,
            "embed_dim": spec.vision_embed_dim,
            "hidden_size": spec.hidden_size,  # the merger's output feeds the text model
            "num_heads": spec.vision_heads,
            "mlp_ratio": 2,
            "in_channels": 3,
            "in_chans": 3,
            "patch_size": PATCH_SIZE,
            "spatial_patch_size": PATCH_SIZE,
            "spatial_merge_size": MERGE_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        },
        "torch_dtype": "float32",
    }


def _param_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Names and shapes of mlx-vlm's Qwen2-VL parameters, from its own model as load() makes it."""
    from worker.backends.mlx_vlm import qwen2_vl_parameter_shapes

    return qwen2_vl_parameter_shapes(config)


def _init_param(name: str, shape: tuple[int, ...], key: mx.array, spec: TinyVisionSpec) -> mx.array:
    import mlx.core as mx

    if len(shape) == 1:  # norm scales (RMS and layer norms) and biases
        return mx.ones(shape) if name.endswith(".weight") else mx.zeros(shape)
    if name.endswith("embed_tokens.weight"):
        return mx.random.normal(shape, key=key)
    std = math.prod(shape[1:]) ** -0.5  # fan-in (the patch conv is out, t, h, w, in)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        std /= math.sqrt(2 * spec.num_layers)
    elif name.endswith("lm_head.weight"):
        std *= spec.logit_scale
    return mx.random.normal(shape, key=key) * std


def _random_weights(spec: TinyVisionSpec, seed: int, config: dict[str, Any]) -> dict[str, mx.array]:
    import mlx.core as mx

    shapes = _param_shapes(config)
    keys = mx.random.split(mx.random.key(seed), len(shapes))
    return {
        name: _init_param(name, shape, keys[i], spec)
        for i, (name, shape) in enumerate(shapes.items())
    }


def _write_weights(path: Path, weights: dict[str, mx.array]) -> None:
    import mlx.core as mx

    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})


# --- build -------------------------------------------------------------------------------------


def _validate(spec: TinyVisionSpec) -> None:
    sizes = (spec.hidden_size, spec.num_layers, spec.intermediate_size, spec.vocab_size)
    if min(*sizes, spec.vision_embed_dim, spec.vision_depth, spec.vision_heads) < 1:
        raise ValueError("sizes must be positive")
    if spec.vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens")
    if spec.hidden_size % spec.num_heads or spec.num_heads % spec.num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, num_heads by num_kv_heads")
    if (spec.hidden_size // spec.num_heads) % 8:
        raise ValueError("the head dim must be a multiple of 8 (it splits three ways for mrope)")
    if (
        spec.vision_embed_dim % spec.vision_heads
        or (spec.vision_embed_dim // spec.vision_heads) % 2
    ):
        raise ValueError("vision_embed_dim must divide by vision_heads into an even head dim")
    if not TOKEN_PIXELS**2 <= spec.min_pixels <= spec.max_pixels:
        raise ValueError(f"need {TOKEN_PIXELS**2} <= min_pixels <= max_pixels")


def build_tiny_vision_model(
    out_dir: str | Path,
    seed: int = 0,
    *,
    spec: TinyVisionSpec = DEFAULT_VISION_SPEC,
    corpus: str | None = None,
) -> Path:
    """Write a random Qwen2-VL model that `mlx_vlm.load` loads into `out_dir`; returns it.

    The folder is created; existing files are overwritten. The same seed, spec and corpus give
    byte-identical files. `corpus` replaces the tokenizer's built-in training text (its
    non-printable characters are dropped). The model's vocab_size is the trained vocab's size.
    """
    _validate(spec)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(spec, corpus)
    config = _model_config(spec, seed, tokenizer.get_vocab_size())
    _write_weights(out, _random_weights(spec, seed, config))
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(spec))
    _write_json(out / "special_tokens_map.json", _special_tokens_map())
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": ENDOFTEXT_ID, "eos_token_id": IM_END_ID, "pad_token_id": ENDOFTEXT_ID},
    )
    image_config = _image_processor_config(spec)
    _write_json(out / "preprocessor_config.json", image_config)
    # mlx-vlm looks these two up on the Hub when the folder lacks them.
    video_config = {**image_config, "video_processor_type": "Qwen2VLVideoProcessor"}
    _write_json(out / "video_preprocessor_config.json", video_config)
    _write_json(out / "processor_config.json", {"processor_class": "Qwen2VLProcessor"})
    _write_json(out / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    _write_json(out / "config.json", config)
    return out


# --- command line ------------------------------------------------------------------------------


# Bump when the generator or the demo's spec changes, so cached demo models are rebuilt.
VISION_DEMO_VERSION = "v1"
# the embedded default's vision model: wide greedy margins, as the text demo's
VISION_DEMO_SPEC = TinyVisionSpec(logit_scale=8.0)


def ensure_vision_demo() -> Path:
    """The embedded default's vision model, built once into the cache (random weights)."""
    from worker.modelgen import cache_dir, ensure_built

    final = cache_dir() / "models" / f"demo-qwen2-vl-{VISION_DEMO_VERSION}"
    return ensure_built(
        final,
        lambda tmp: build_tiny_vision_model(tmp, seed=0, spec=VISION_DEMO_SPEC),
        lambda path: all((path / name).is_file() for name in MODEL_FILES),
    )


def _parser() -> argparse.ArgumentParser:
    d = DEFAULT_VISION_SPEC
    p = argparse.ArgumentParser(
        prog="python -m worker.vision.modelgen",
        description="Build a tiny random Qwen2-VL model for mlx_vlm.",
    )
    p.add_argument("out_dir", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=d.hidden_size)
    p.add_argument("--layers", type=int, default=d.num_layers)
    p.add_argument("--vocab", type=int, default=d.vocab_size, help="BPE target vocab size")
    p.add_argument("--logit-scale", type=float, default=d.logit_scale)
    p.add_argument("--min-pixels", type=int, default=d.min_pixels)
    p.add_argument("--max-pixels", type=int, default=d.max_pixels)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    spec = TinyVisionSpec(
        hidden_size=args.hidden,
        num_layers=args.layers,
        vocab_size=args.vocab,
        logit_scale=args.logit_scale,
        min_pixels=args.min_pixels,
        max_pixels=args.max_pixels,
    )
    start = time.perf_counter()
    out = build_tiny_vision_model(args.out_dir, args.seed, spec=spec)
    elapsed = time.perf_counter() - start
    params = count_parameters(out)
    size_mb = (out / "model.safetensors").stat().st_size / 1e6
    lo, hi = spec.min_pixels // TOKEN_PIXELS**2, spec.max_pixels // TOKEN_PIXELS**2
    print(
        f"built {out}: {params:,} parameters, vocab {_vocab_size(out)}, {size_mb:.1f} MB, "
        f"about {lo}-{hi} image tokens per image, {elapsed:.1f}s"
    )
    return 0


def _vocab_size(path: Path) -> int:
    return int(json.loads((path / "config.json").read_text(encoding="utf-8"))["vocab_size"])


if __name__ == "__main__":
    raise SystemExit(main())
