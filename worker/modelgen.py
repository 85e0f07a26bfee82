"""Tiny random-weight Llama models on disk that `mlx_lm.load` loads, for tests, demos and benches.

Everything is generated offline: a byte-level BPE tokenizer trained on a built-in synthetic
corpus, random weights in the layout of `mlx_lm.models.llama`, and the HF-style JSON files.
The weights are random, so the text is gibberish; `bigram` mode makes greedy decoding a
deterministic function of the current token for end-to-end tests.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.paths import cache_dir
from worker.chat_templates import CHAT_TEMPLATE as CHAT_TEMPLATE  # re-exported
from worker.chat_templates import TOOL_FORMATS, chat_template, format_tokens
from worker.corpus import builtin_corpus
from worker.engine.tokens import byte_to_unicode

if TYPE_CHECKING:
    import mlx.core as mx
    from tokenizers import Tokenizer

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# The trainer numbers special tokens first. The eos id must be non-zero: mlx_lm ignores a
# falsy `eos_token_id` in generation_config.json.
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2

RANDOM_WEIGHTS_COMMENT = "Test model with random weights (mlx-gateway worker.modelgen): gibberish."
BIGRAM_SCALE = 50.0
RMS_NORM_EPS = 1e-5
ROPE_THETA = 10000.0
DTYPES = ("float32", "bfloat16", "float16")
# mlx-lm's model type -> the Hugging Face architecture (Qwen2: biased Q/K/V projections, and
# mlx-lm's pipeline-parallel support)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Bump when the generator or DEMO_SPEC changes, so cached demo models are rebuilt.
DEMO_VERSION = "v3"

MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """Shape and behaviour of a generated model. `vocab_size` is the BPE training target."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    byte_fallback: bool = False
    logit_scale: float = 1.0
    bigram: dict[int, int] | None = None
    seed: int = 0
    dtype: str = "float32"
    # False: no chat template at all (a base model: completions only, chat is refused).
    chat_template: bool = True
    # Tool calls in the template ("hermes" JSON or "qwen3_coder" XML, worker/chat_templates.py)
    # with <tool_call> and <tool_response> tokens; thinking: <think> tokens and a template
    # whose generation prompt opens the reasoning unless enable_thinking is false.
    tool_format: str | None = None
    thinking: bool = False
    model_type: str = "llama"


DEFAULT_SPEC = TinyModelSpec()
DEMO_SPEC = TinyModelSpec(
    hidden_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=256,
    vocab_size=1024,
    logit_scale=2.0,
    seed=0,
    tool_format="hermes",
    thinking=True,
)


# --- vocabulary --------------------------------------------------------------------------------


def is_printable_text(text: str) -> bool:
    """Printable ASCII (0x20-0x7E) plus newline and tab, non-empty."""
    return bool(text) and all(map(_printable_char, text))


def _printable_char(c: str) -> bool:
    return c in "\n\t" or " " <= c <= "~"


def _printable_bytes() -> list[int]:
    return [0x09, 0x0A, *range(0x20, 0x7F)]


def byte_token_id(tokenizer: str | Path, byte_value: int) -> int:
    """The id of the token for one raw byte, from tokenizer.json or the model dir holding it."""
    if not 0 <= byte_value <= 0xFF:
        raise ValueError(f"not a byte: {byte_value}")
    path = Path(tokenizer)
    if path.is_dir():
        path = path / "tokenizer.json"
    vocab: dict[str, int] = json.loads(path.read_text(encoding="utf-8"))["model"]["vocab"]
    char = byte_to_unicode()[byte_value]
    if char not in vocab:
        raise KeyError(f"no token for byte 0x{byte_value:02X} in {path}")
    return vocab[char]


def _printable_only(text: str) -> str:
    return "".join(filter(_printable_char, text))


# --- tokenizer ---------------------------------------------------------------------------------


def _train_tokenizer(spec: TinyModelSpec, corpus: str | None) -> Tokenizer:
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    text = (
        corpus
        if corpus is not None
        else builtin_corpus(max(8000, spec.vocab_size * 30), non_ascii=spec.byte_fallback)
    )
    table = byte_to_unicode()
    if spec.byte_fallback:
        alphabet = [table[b] for b in range(256)]
    else:
        text = _printable_only(text)
        alphabet = [table[b] for b in _printable_bytes()]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator([text], trainer)
    # The template's markers, after the trained vocab: whole tokens, but text (not special),
    # so that decoding keeps them, as in Qwen's tokenizers.
    markers = format_tokens(spec.tool_format, spec.thinking)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in markers])
    _check_vocab(tokenizer, spec.byte_fallback)
    return tokenizer


def _check_vocab(tokenizer: Tokenizer, byte_fallback: bool) -> None:
    for token, want in zip(SPECIAL_TOKENS, (ENDOFTEXT_ID, IM_START_ID, IM_END_ID), strict=True):
        if tokenizer.token_to_id(token) != want:
            raise RuntimeError(f"special token {token} did not get id {want}")
    if byte_fallback:
        return
    for i in range(len(SPECIAL_TOKENS), tokenizer.get_vocab_size()):
        text = tokenizer.decode([i])
        if not is_printable_text(text):
            raise RuntimeError(f"token {i} decodes to non-printable {text!r}")


def _tokenizer_config(spec: TinyModelSpec) -> dict[str, Any]:
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": ENDOFTEXT,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.max_position_embeddings,
    }
    if spec.chat_template:
        config["chat_template"] = chat_template(spec.tool_format, spec.thinking)
    return config


def _special_tokens_map() -> dict[str, Any]:
    return {
        "bos_token": ENDOFTEXT,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "additional_special_tokens": [IM_START, IM_END],
    }


# --- weights -----------------------------------------------------------------------------------


def _model_config(spec: TinyModelSpec, vocab_size: int) -> dict[str, Any]:
    extra = asdict(spec)
    extra["bigram"] = sorted(spec.bigram.items()) if spec.bigram else None
    return {
        "_comment": RANDOM_WEIGHTS_COMMENT,
        "mlx_gateway_demo": True,
        "mlx_gateway_spec": extra,
        "architectures": [ARCHITECTURES[spec.model_type]],
        "model_type": spec.model_type,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.hidden_size // spec.num_heads,
        "intermediate_size": spec.intermediate_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_theta": ROPE_THETA,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": IM_END_ID,
        "pad_token_id": ENDOFTEXT_ID,
        "torch_dtype": spec.dtype,
    }


def _param_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Names and shapes of mlx_lm's llama parameters; the model's own arrays stay lazy."""
    from worker.backends.mlx_lm import parameter_shapes

    return parameter_shapes(config)


def _init_param(name: str, shape: tuple[int, ...], key: mx.array, spec: TinyModelSpec) -> mx.array:
    import mlx.core as mx

    if len(shape) == 1:
        return mx.zeros(shape) if name.endswith(".bias") else mx.ones(shape)
    if name.endswith("embed_tokens.weight"):
        return mx.random.normal(shape, key=key)
    std = shape[-1] ** -0.5
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        std /= math.sqrt(2 * spec.num_layers)
    elif name == "lm_head.weight":
        std *= spec.logit_scale
    return mx.random.normal(shape, key=key) * std


def _random_weights(spec: TinyModelSpec, config: dict[str, Any]) -> dict[str, mx.array]:
    import mlx.core as mx

    shapes = _param_shapes(config)
    keys = mx.random.split(mx.random.key(spec.seed), len(shapes))
    return {
        name: _init_param(name, shape, keys[i], spec)
        for i, (name, shape) in enumerate(shapes.items())
    }


def _apply_bigram(weights: dict[str, mx.array], bigram: Mapping[int, int]) -> None:
    """Silence every layer and point lm_head row b at the embedding of each a -> b."""
    import mlx.core as mx

    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = mx.zeros_like(weights[name])
    embed = weights["model.embed_tokens.weight"]
    lm_head = weights["lm_head.weight"]
    vocab = embed.shape[0]
    bad = [t for pair in bigram.items() for t in pair if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"bigram token ids out of range [0, {vocab}): {bad}")
    src = mx.array(list(bigram.keys()))
    dst = mx.array(list(bigram.values()))
    rows = embed[src]
    rows = rows / mx.linalg.norm(rows, axis=-1, keepdims=True)
    targets = mx.zeros_like(lm_head).at[dst].add(rows * BIGRAM_SCALE)
    hit = mx.zeros((vocab, 1)).at[dst].add(mx.ones((dst.size, 1))) > 0
    weights["lm_head.weight"] = mx.where(hit, targets, lm_head)


def _write_weights(path: Path, weights: dict[str, mx.array], dtype: str) -> None:
    import mlx.core as mx

    cast = {name: w.astype(getattr(mx, dtype)) for name, w in weights.items()}
    mx.save_safetensors(str(path / "model.safetensors"), cast, metadata={"format": "mlx"})
    # the index large models ship with (mlx-lm's pipeline loading reads it)
    index = {"metadata": {}, "weight_map": {name: "model.safetensors" for name in sorted(cast)}}
    _write_json(path / "model.safetensors.index.json", index)


# --- build -------------------------------------------------------------------------------------


def _validate(spec: TinyModelSpec) -> None:
    if spec.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {spec.dtype!r}")
    if spec.model_type not in ARCHITECTURES:
        raise ValueError(f"model_type must be one of {tuple(ARCHITECTURES)}")
    if spec.hidden_size % spec.num_heads:
        raise ValueError("hidden_size must be a multiple of num_heads")
    if spec.num_heads % spec.num_kv_heads:
        raise ValueError("num_heads must be a multiple of num_kv_heads")
    if min(spec.hidden_size, spec.num_layers, spec.intermediate_size, spec.vocab_size) < 1:
        raise ValueError("sizes must be positive")
    if spec.tool_format is not None and spec.tool_format not in TOOL_FORMATS:
        raise ValueError(f"tool_format must be one of {TOOL_FORMATS}, not {spec.tool_format!r}")
    if (spec.tool_format or spec.thinking) and not spec.chat_template:
        raise ValueError("tool_format and thinking need a chat template")


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build_tiny_model(
    path: str | Path, spec: TinyModelSpec = DEFAULT_SPEC, *, corpus: str | None = None
) -> Path:
    """Write a loadable random model into `path` (created; existing files are overwritten).

    `corpus` replaces the built-in tokenizer training text; without byte_fallback its
    non-printable characters are dropped. The model's vocab_size is the trained vocab's size,
    plus the template's marker tokens (tool_format, thinking) added after it.
    """
    _validate(spec)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(spec, corpus)
    config = _model_config(spec, tokenizer.get_vocab_size())
    weights = _random_weights(spec, config)
    if spec.bigram:
        _apply_bigram(weights, spec.bigram)
    _write_weights(out, weights, spec.dtype)
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(spec))
    _write_json(out / "special_tokens_map.json", _special_tokens_map())
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": ENDOFTEXT_ID, "eos_token_id": IM_END_ID, "pad_token_id": ENDOFTEXT_ID},
    )
    _write_json(out / "config.json", config)
    return out


def count_parameters(path: str | Path) -> int:
    """Parameters in a model dir's model.safetensors (or the given file), from its header."""
    file = Path(path)
    if file.is_dir():
        file = file / "model.safetensors"
    with file.open("rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header: dict[str, Any] = json.loads(fh.read(length))
    return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")


# --- demo model --------------------------------------------------------------------------------


def demo_model_path() -> Path:
    """Where the demo model lives; honours MLX_GATEWAY_CACHE_DIR."""
    return cache_dir() / "models" / f"demo-llama-{DEMO_VERSION}"


def _is_complete(path: Path) -> bool:
    if not all((path / name).is_file() for name in MODEL_FILES):
        return False
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return config.get("mlx_gateway_demo") is True


def _discard(path: Path) -> None:
    """Move a stale directory out of the way atomically, then delete it."""
    aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.stale.", dir=path.parent))
    with contextlib.suppress(FileNotFoundError):
        os.replace(path, aside / path.name)
    shutil.rmtree(aside, ignore_errors=True)


def ensure_demo_model() -> Path:
    """Build the demo model once, atomically (temp dir beside it, then os.replace)."""
    return ensure_built(demo_model_path(), lambda tmp: build_tiny_model(tmp, DEMO_SPEC))


def ensure_built(
    final: Path,
    build: Callable[[Path], object],
    complete: Callable[[Path], bool] = _is_complete,
) -> Path:
    """A generated model folder, built once: into a temp dir beside it, then os.replace (a
    folder at `final` is whole; one that `complete` rejects is stale and rebuilt)."""
    if final.is_dir() and complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists():
        _discard(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp.", dir=final.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        build(tmp)
        try:
            os.replace(tmp, final)
        except OSError:
            if not complete(final):  # not another process winning the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# --- command line ------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    d = DEFAULT_SPEC
    p = argparse.ArgumentParser(
        prog="python -m worker.modelgen", description="Build a tiny random Llama model for mlx_lm."
    )
    p.add_argument("out_dir", type=Path)
    p.add_argument("--hidden", type=int, default=d.hidden_size)
    p.add_argument("--layers", type=int, default=d.num_layers)
    p.add_argument("--heads", type=int, default=d.num_heads)
    p.add_argument("--kv-heads", type=int, default=d.num_kv_heads)
    p.add_argument("--intermediate", type=int, default=d.intermediate_size)
    p.add_argument("--vocab", type=int, default=d.vocab_size, help="BPE target vocab size")
    p.add_argument("--max-position", type=int, default=d.max_position_embeddings)
    p.add_argument("--logit-scale", type=float, default=d.logit_scale)
    p.add_argument("--byte-fallback", action="store_true", help="full 256-byte alphabet")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--dtype", choices=DTYPES, default=d.dtype)
    p.add_argument("--tool-format", choices=TOOL_FORMATS, help="tool calls in the template")
    p.add_argument("--thinking", action="store_true", help="<think> tokens and template")
    p.add_argument("--model-type", choices=tuple(ARCHITECTURES), default=d.model_type)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    spec = TinyModelSpec(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        intermediate_size=args.intermediate,
        vocab_size=args.vocab,
        max_position_embeddings=args.max_position,
        byte_fallback=args.byte_fallback,
        logit_scale=args.logit_scale,
        seed=args.seed,
        dtype=args.dtype,
        tool_format=args.tool_format,
        thinking=args.thinking,
        model_type=args.model_type,
    )
    start = time.perf_counter()
    out = build_tiny_model(args.out_dir, spec)
    elapsed = time.perf_counter() - start
    params = count_parameters(out)
    vocab = json.loads((out / "config.json").read_text(encoding="utf-8"))["vocab_size"]
    size_mb = (out / "model.safetensors").stat().st_size / 1e6
    print(
        f"built {out}: {params:,} parameters ({params / 1e6:.1f}M), vocab {vocab}, "
        f"{spec.dtype}, {size_mb:.1f} MB, {elapsed:.1f}s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
