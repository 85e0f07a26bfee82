"""Tiny random-weight Qwen3-TTS models that `mlx_audio.tts.load` loads offline, for tests
and demos.

A "custom_voice" Qwen3-TTS: a talker (one layer) that writes `num_code_groups` codec codes
per frame at 12.5 frames a second, its code predictor, a byte-level BPE text tokenizer with
Qwen's chat and tts special tokens, named voices (talker_config.spk_id) and languages, and a
speech tokenizer with a decoder only (no voice cloning) that turns each frame into
sample_rate / 12.5 samples. The weights are random, so the audio is noise; generation stops
at the model's random end-of-speech code or after `max_new_tokens` frames
(generation_config.json), so it always ends.

The vocoder is what a CPU spends its time on: by default it makes 2 kHz audio in one
upsampling block, the least whose weights mlx-audio still reads in their layout (its loader
guesses a conv weight's layout from its shape: each kernel must be shorter than its input
channels, and 1-wide kernels need more than 64 of them).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.corpus import builtin_corpus
from worker.modelgen import _write_json, count_parameters

if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn
    from tokenizers import Tokenizer

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|tts_pad|>",
    "<|tts_bos|>",
    "<|tts_eos|>",
)
# mlx-audio cuts its prompt "<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n"
# by token counts ([:3], [3:-5]): these words must be one token each.
ROLE_WORDS = ("assistant", "user")
RANDOM_WEIGHTS_COMMENT = (
    "Test model with random weights (mlx-gateway worker.speech.tts_modelgen): noise."
)
FRAME_RATE = 12.5  # codec frames a second (Qwen3-TTS's 12 Hz tokenizer)
UPSAMPLING_RATIOS = (2, 2)  # the decoder's upsampling before its one block
# Qwen3-TTS's codec vocabulary: codes 0..2047, then control ids; generation suppresses the
# last 1024 ids but end-of-speech, so the size stays 3072.
CODEC_VOCAB = 3072
CODEBOOK_SIZE = 2048
CODEC_IDS = {
    "codec_pad_id": 2148,
    "codec_bos_id": 2149,
    "codec_eos_token_id": 2150,
    "codec_think_id": 2154,
    "codec_nothink_id": 2155,
    "codec_think_bos_id": 2156,
    "codec_think_eos_id": 2157,
}
FIRST_LANGUAGE_ID, FIRST_SPEAKER_ID = 2050, 3000
HEAD_DIM = 16

MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "speech_tokenizer/config.json",
    "speech_tokenizer/model.safetensors",
)


@dataclass(frozen=True, slots=True)
class TinyTTSSpec:
    """Shape and behaviour of a generated model. `output_gain` scales the vocoder's last
    layer, so that the noise stays mostly within [-1, 1] (mlx-audio clips it there)."""

    hidden_size: int = 32
    num_layers: int = 1
    text_vocab_size: int = 400  # the BPE training target, specials included
    voices: tuple[str, ...] = ("alloy", "echo", "nova")
    languages: tuple[str, ...] = ("english", "german", "french")
    num_code_groups: int = 4  # codes per frame (Qwen3-TTS: 16)
    sample_rate: int = 2000
    decoder_dim: int = 136
    max_new_tokens: int = 12  # frames: about a second of audio at most
    temperature: float = 0.9
    output_gain: float = 0.05
    dtype: str = "float16"


DEFAULT_TTS_SPEC = TinyTTSSpec()


def upsample_rate(spec: TinyTTSSpec) -> int:
    """The decoder block's upsampling: samples a frame over the fixed ratios."""
    return int(spec.sample_rate / FRAME_RATE) // math.prod(UPSAMPLING_RATIOS)


# --- tokenizer ---------------------------------------------------------------------------------


def _train_tokenizer(spec: TinyTTSSpec) -> Tokenizer:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.text_vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([builtin_corpus(max(8000, spec.text_vocab_size * 30))], trainer)
    tokenizer.add_tokens([AddedToken(word, normalized=False) for word in ROLE_WORDS])
    head = tokenizer.encode("<|im_start|>assistant\n").ids
    tail = tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n").ids
    if len(head) != 3 or len(tail) != 5:
        raise RuntimeError("the role words and newline did not become single tokens")
    return tokenizer


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "clean_up_tokenization_spaces": False,
    }


# --- configs -----------------------------------------------------------------------------------


def _model_config(spec: TinyTTSSpec, seed: int, tokenizer: Tokenizer) -> dict[str, Any]:
    hidden, token = spec.hidden_size, tokenizer.token_to_id
    small = {
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
    }
    return {
        "_comment": RANDOM_WEIGHTS_COMMENT,
        "mlx_gateway_spec": {**asdict(spec), "seed": seed},
        "model_type": "qwen3_tts",
        "tts_model_type": "custom_voice",
        "tokenizer_type": "qwen3_tts_tokenizer_12hz",
        "im_start_token_id": token("<|im_start|>"),
        "im_end_token_id": token("<|im_end|>"),
        "tts_pad_token_id": token("<|tts_pad|>"),
        "tts_bos_token_id": token("<|tts_bos|>"),
        "tts_eos_token_id": token("<|tts_eos|>"),
        "sample_rate": spec.sample_rate,
        "talker_config": {
            **small,
            "vocab_size": CODEC_VOCAB,
            "max_position_embeddings": 4096,
            "rope_theta": 10000.0,
            # head_dim 16: 8 rotary pairs over time, height, width
            "rope_scaling": {
                "interleaved": True, "mrope_section": [4, 2, 2], "rope_type": "default",
            },
            "num_code_groups": spec.num_code_groups,
            "text_hidden_size": hidden,
            "text_vocab_size": tokenizer.get_vocab_size(),
            **CODEC_IDS,
            "codec_language_id": {n: FIRST_LANGUAGE_ID + i for i, n in enumerate(spec.languages)},
            "spk_id": {v: [FIRST_SPEAKER_ID + i] for i, v in enumerate(spec.voices)},
            "spk_is_dialect": {v: False for v in spec.voices},
            "code_predictor_config": {
                **small,
                "vocab_size": CODEBOOK_SIZE,
                "max_position_embeddings": 64,
                "num_code_groups": spec.num_code_groups,
            },
        },
    }  # fmt: skip


def _speech_tokenizer_config(spec: TinyTTSSpec) -> dict[str, Any]:
    per_frame = int(spec.sample_rate / FRAME_RATE)
    return {
        "input_sample_rate": spec.sample_rate,
        "output_sample_rate": spec.sample_rate,
        "decode_upsample_rate": per_frame,
        "encode_downsample_rate": per_frame,
        "encoder_valid_num_quantizers": spec.num_code_groups,
        "decoder_config": {
            "latent_dim": 96,
            "codebook_dim": 160,
            "codebook_size": CODEBOOK_SIZE,
            "decoder_dim": spec.decoder_dim,
            "hidden_size": 96,
            "intermediate_size": 192,
            "head_dim": 48,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "num_hidden_layers": 1,
            "num_quantizers": spec.num_code_groups,
            "num_semantic_quantizers": 1,
            "semantic_codebook_size": CODEBOOK_SIZE,
            "sliding_window": 72,
            "upsample_rates": [upsample_rate(spec)],
            "upsampling_ratios": list(UPSAMPLING_RATIOS),
            "vector_quantization_hidden_dimension": 160,
        },
    }


# --- weights -----------------------------------------------------------------------------------


def _random_weights(
    module: nn.Module, seed: int, dtype: str, scaled: dict[str, float] | None = None
) -> dict[str, mx.array]:
    """Every parameter of `module` (mlx-audio's own, as load() builds it): norm scales and
    snake alphas 1, other vectors 0, matrices and conv kernels normal / sqrt(fan-in)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    params = dict(tree_flatten(module.parameters()))
    missing = set(scaled or {}) - set(params)
    if missing:
        raise RuntimeError(f"no such parameters to scale: {sorted(missing)}")
    keys = mx.random.split(mx.random.key(seed), len(params))
    out = {}
    for i, name in enumerate(sorted(params)):
        shape, last = params[name].shape, name.rsplit(".", 1)[-1]
        if len(shape) == 1:
            one = last in ("weight", "scale", "gamma", "alpha") or "norm" in name
            value = mx.ones(shape) if one else mx.zeros(shape)
        else:
            fan_in = math.prod(shape[1:])  # (out, in) and MLX convs' (out, kernel, in)
            value = mx.random.normal(shape, key=keys[i]) * fan_in**-0.5
            value = value * (scaled or {}).get(name, 1.0)
        out[name] = value.astype(getattr(mx, dtype))
    return out


def _write_model(out: Path, spec: TinyTTSSpec, seed: int, config: dict[str, Any]) -> None:
    import mlx.core as mx
    from mlx_audio.tts.models.qwen3_tts.config import ModelConfig
    from mlx_audio.tts.models.qwen3_tts.qwen3_tts import Model

    model = Model(ModelConfig.from_dict(config))
    weights = _random_weights(model, seed, spec.dtype)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})


def _write_speech_tokenizer(out: Path, spec: TinyTTSSpec, seed: int) -> None:
    import mlx.core as mx
    from mlx_audio.tts.models.qwen3_tts.config import Qwen3TTSTokenizerConfig
    from mlx_audio.tts.models.qwen3_tts.speech_tokenizer import Qwen3TTSSpeechTokenizer

    config = _speech_tokenizer_config(spec)
    folder = out / "speech_tokenizer"
    folder.mkdir(exist_ok=True)
    tokenizer = Qwen3TTSSpeechTokenizer(Qwen3TTSTokenizerConfig(**config))
    last = f"decoder.decoder.{len(tokenizer.decoder.decoder) - 1}.conv.weight"
    weights = _random_weights(tokenizer, seed + 1, spec.dtype, {last: spec.output_gain})
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    _write_json(folder / "config.json", config)


# --- build -------------------------------------------------------------------------------------


def _validate(spec: TinyTTSSpec) -> None:
    if min(spec.hidden_size, spec.num_layers, spec.num_code_groups, spec.max_new_tokens) < 1:
        raise ValueError("sizes must be positive")
    if not spec.voices or len(set(spec.voices)) != len(spec.voices):
        raise ValueError("voices must be distinct, and at least one")
    per_frame = spec.sample_rate / FRAME_RATE
    if per_frame != int(per_frame) or int(per_frame) % math.prod(UPSAMPLING_RATIOS):
        raise ValueError("sample_rate must be a multiple of 50 (12.5 frames a second, x4)")
    if spec.decoder_dim % 2 or spec.decoder_dim // 2 <= 64:
        raise ValueError("decoder_dim must be even and over 128 (1-wide kernels: > 64 inputs)")
    if 2 * upsample_rate(spec) >= spec.decoder_dim:
        raise ValueError(
            f"sample_rate {spec.sample_rate} needs decoder_dim over {2 * upsample_rate(spec)}"
            " (the upsampling kernel must be shorter than its input channels)"
        )


def build_tiny_tts(
    out_dir: str | Path, seed: int = 0, *, spec: TinyTTSSpec = DEFAULT_TTS_SPEC
) -> Path:
    """Write a random Qwen3-TTS custom_voice model that `mlx_audio.tts.load` loads into
    `out_dir` (created; existing files are overwritten); returns it. The same seed and spec
    give byte-identical files."""
    _validate(spec)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(spec)
    config = _model_config(spec, seed, tokenizer)
    _write_model(out, spec, seed, config)
    _write_speech_tokenizer(out, spec, seed)
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config())
    _write_json(
        out / "generation_config.json",
        {
            "max_new_tokens": spec.max_new_tokens,
            "temperature": spec.temperature,
            "top_k": 50,
            "top_p": 1.0,
            "repetition_penalty": 1.05,
        },
    )
    _write_json(out / "config.json", config)
    return out


# --- command line ------------------------------------------------------------------------------


# Bump when the generator or the demo's spec changes, so cached demo models are rebuilt.
TTS_DEMO_VERSION = "v1"


def ensure_tts_demo() -> Path:
    """The embedded default's speech model, built once into the cache (random weights)."""
    from worker.modelgen import cache_dir, ensure_built

    final = cache_dir() / "models" / f"demo-qwen3-tts-{TTS_DEMO_VERSION}"
    return ensure_built(
        final,
        lambda tmp: build_tiny_tts(tmp, seed=0),
        lambda path: all((path / name).is_file() for name in MODEL_FILES),
    )


def _parser() -> argparse.ArgumentParser:
    d = DEFAULT_TTS_SPEC
    p = argparse.ArgumentParser(
        prog="python -m worker.speech.tts_modelgen",
        description="Build a tiny random Qwen3-TTS (custom voice) model for mlx_audio.",
    )
    p.add_argument("out_dir", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=d.hidden_size)
    p.add_argument("--sample-rate", type=int, default=d.sample_rate)
    p.add_argument("--decoder-dim", type=int, default=d.decoder_dim)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--voices", default=",".join(d.voices), help="comma-separated names")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    spec = TinyTTSSpec(
        hidden_size=args.hidden,
        sample_rate=args.sample_rate,
        decoder_dim=args.decoder_dim,
        max_new_tokens=args.max_new_tokens,
        voices=tuple(v.strip() for v in args.voices.split(",") if v.strip()),
    )
    start = time.perf_counter()
    out = build_tiny_tts(args.out_dir, args.seed, spec=spec)
    elapsed = time.perf_counter() - start
    params = count_parameters(out) + count_parameters(out / "speech_tokenizer")
    size_mb = sum(f.stat().st_size for f in out.rglob("*.safetensors")) / 1e6
    print(
        f"built {out}: {params:,} parameters, {size_mb:.1f} MB, voices "
        f"{', '.join(spec.voices)}, {spec.sample_rate} Hz, at most "
        f"{spec.max_new_tokens / FRAME_RATE:.2f}s of audio, {elapsed:.1f}s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
