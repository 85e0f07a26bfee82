"""Tiny Whisper models that `mlx_audio.stt.load` loads offline, for tests and demos.

The vocabulary has real Whisper's layout, so mlx-audio's decoding (language tokens, tasks,
timestamps) runs unchanged: text tokens first (a small byte-level BPE trained on
worker/corpus.py's text, padded with unreachable filler words up to Whisper's count), then
<|endoftext|>, <|startoftranscript|>, 99 language tokens, the task and control tokens and the
1501 timestamp tokens <|0.00|>..<|30.00|>. A multilingual model has 51865 tokens, an
English-only one 51864 (one text token fewer), as OpenAI's.

Weights are random. A `scripted` model silences every residual branch of the decoder, so its
output at position p is LayerNorm(token embedding + positional embedding p); positional rows
made large and pointing at chosen tokens' embeddings make greedy decoding say the spec's
`script` between <|0.00|> and its end timestamp, and detect the spec's `language`, whatever
the audio. A prompt before the audio shifts the positions, so it changes what is said.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from worker.corpus import builtin_corpus
from worker.modelgen import _write_json, count_parameters

if TYPE_CHECKING:
    import mlx.core as mx
    from tokenizers import Tokenizer

ENDOFTEXT = "<|endoftext|>"
LANGUAGES = 99  # language tokens of a pre-v3 model (large-v3's 100th is Cantonese)
CONTROL_TOKENS = (
    "<|translate|>",
    "<|transcribe|>",
    "<|startoflm|>",
    "<|startofprev|>",
    "<|nocaptions|>",
    "<|notimestamps|>",
)
TIMESTAMPS = 1501  # <|0.00|> .. <|30.00|>, 0.02 s apart
TIME_STEP = 0.02
MULTILINGUAL_VOCAB = 51865  # mlx-audio: a model with at least this many tokens is multilingual
RANDOM_WEIGHTS_COMMENT = "Test model with random weights (mlx-gateway worker.speech.stt_modelgen)."
SCRIPT_SCALE = 100.0  # how far a scripted position's row outweighs the token embedding

MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "preprocessor_config.json",
)


@dataclass(frozen=True, slots=True)
class TinyWhisperSpec:
    """Shape of a generated model, and what a scripted one says. `vocab_size` is the BPE
    training target; the model's vocabulary is Whisper's size whatever it is."""

    n_state: int = 32
    n_head: int = 1
    n_layer: int = 1
    n_text_ctx: int = 64
    n_mels: int = 80
    vocab_size: int = 512
    multilingual: bool = True
    language: str = "de"  # what a scripted multilingual model detects
    script: str = " hello world"  # what a scripted model says, from 0 s
    script_end: float = 1.0  # the end of its one segment, in seconds


DEFAULT_WHISPER_SPEC = TinyWhisperSpec()


def language_codes() -> list[str]:
    """Whisper's language codes in its token order (mlx-audio's list, OpenAI's order)."""
    from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES as NAMES

    return list(NAMES)[:LANGUAGES]


def special_tokens() -> list[str]:
    """Whisper's special tokens in id order (the same for both vocabulary sizes)."""
    tokens = [ENDOFTEXT, "<|startoftranscript|>", *(f"<|{c}|>" for c in language_codes())]
    tokens += CONTROL_TOKENS
    return tokens + [f"<|{i * TIME_STEP:.2f}|>" for i in range(TIMESTAMPS)]


def text_tokens(spec: TinyWhisperSpec) -> int:
    """Ordinary text tokens: 50257 (multilingual) or 50256 (English-only)."""
    return MULTILINGUAL_VOCAB - len(special_tokens()) - (0 if spec.multilingual else 1)


# --- tokenizer ---------------------------------------------------------------------------------


def _train_tokenizer(spec: TinyWhisperSpec) -> Tokenizer:
    """A byte-level BPE padded with filler words to Whisper's text token count, then the
    special tokens, numbered after it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    small = Tokenizer(models.BPE())
    small.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    small.train_from_iterator([builtin_corpus(max(8000, spec.vocab_size * 30))], trainer)
    vocab = dict(small.get_vocab())
    count = text_tokens(spec)
    # filler words " w0", " w1", ... (Ġ is byte-level's space): never produced by encoding
    fillers = (f"\u0120w{i}" for i in range(count))
    for word in fillers:
        if len(vocab) == count:
            break
        vocab.setdefault(word, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=_merges(small)))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = special_tokens()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if tokenizer.get_vocab_size() != count + len(specials):
        raise RuntimeError(f"the vocabulary has {tokenizer.get_vocab_size()} tokens")
    return tokenizer


def _merges(tokenizer: Tokenizer) -> list[tuple[str, str]]:
    """A trained BPE's merges, as its JSON holds them ("a b" or ["a", "b"])."""
    pairs = []
    for merge in json.loads(tokenizer.to_str())["model"]["merges"]:
        first, second = merge.split(" ", 1) if isinstance(merge, str) else merge
        pairs.append((first, second))
    return pairs


def _tokenizer_config(spec: TinyWhisperSpec) -> dict[str, Any]:
    return {
        "tokenizer_class": "WhisperTokenizer",
        "bos_token": ENDOFTEXT,
        "eos_token": ENDOFTEXT,
        "unk_token": ENDOFTEXT,
        "pad_token": ENDOFTEXT,
        "add_prefix_space": False,
        "model_max_length": spec.n_text_ctx,
        "processor_class": "WhisperProcessor",
    }


def _feature_config(spec: TinyWhisperSpec) -> dict[str, Any]:
    """Whisper's log-mel front end: 16 kHz, 10 ms hops, 30 s windows."""
    return {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "processor_class": "WhisperProcessor",
        "feature_size": spec.n_mels,
        "sampling_rate": 16000,
        "hop_length": 160,
        "chunk_length": 30,
        "n_fft": 400,
        "n_samples": 480000,
        "nb_max_frames": 3000,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": False,
    }


# --- weights -----------------------------------------------------------------------------------


def _model_config(spec: TinyWhisperSpec, seed: int, scripted: bool) -> dict[str, Any]:
    n_vocab = MULTILINGUAL_VOCAB - (0 if spec.multilingual else 1)
    return {
        "_comment": RANDOM_WEIGHTS_COMMENT,
        "mlx_gateway_spec": {**asdict(spec), "seed": seed, "scripted": scripted},
        "model_type": "whisper",
        "n_mels": spec.n_mels,
        "n_audio_ctx": 1500,  # fixed: a 30 s window is 3000 mel frames, halved by the conv
        "n_audio_state": spec.n_state,
        "n_audio_head": spec.n_head,
        "n_audio_layer": spec.n_layer,
        "n_vocab": n_vocab,
        "n_text_ctx": spec.n_text_ctx,
        "n_text_state": spec.n_state,
        "n_text_head": spec.n_head,
        "n_text_layer": spec.n_layer,
    }


def _random_weights(config: dict[str, Any], seed: int) -> dict[str, mx.array]:
    """mlx-audio's Whisper parameters (names and shapes from its own model), random."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_audio.stt.models.whisper.whisper import Model, ModelDimensions

    model = Model(ModelDimensions.from_dict(config), dtype=mx.float32)
    params: dict[str, Any] = dict(tree_flatten(model.parameters()))
    shapes = {name: tuple(p.shape) for name, p in params.items()}
    keys = mx.random.split(mx.random.key(seed), len(shapes))
    weights = {}
    for key, (name, shape) in zip(keys, sorted(shapes.items()), strict=True):
        if len(shape) == 1:  # layer norm scales and biases
            weights[name] = mx.ones(shape) if name.endswith(".weight") else mx.zeros(shape)
        elif name.endswith("token_embedding.weight"):
            weights[name] = mx.random.normal(shape, key=key)
        else:
            weights[name] = mx.random.normal(shape, key=key) * shape[-1] ** -0.5
    return weights


def _script(weights: dict[str, mx.array], spec: TinyWhisperSpec, tokenizer: Tokenizer) -> None:
    """Make greedy decoding say spec.script (see the module's docstring)."""
    import mlx.core as mx

    for name in list(weights):
        if any(part in name for part in (".attn.out.", ".cross_attn.out.", ".mlp2.")):
            weights[name] = mx.zeros_like(weights[name])
    end = round(spec.script_end / TIME_STEP)
    said = [
        _id(tokenizer, "<|0.00|>"),
        *tokenizer.encode(spec.script, add_special_tokens=False).ids,
        _id(tokenizer, f"<|{end * TIME_STEP:.2f}|>"),
        _id(tokenizer, ENDOFTEXT),
    ]
    # the decoder's output at position p predicts the token at p + 1: a multilingual
    # model's first sampled token follows <|startoftranscript|> <|lang|> <|task|>, an
    # English-only model's <|startoftranscript|> alone
    first = 2 if spec.multilingual else 0
    rows = dict(enumerate(said, start=first))
    if spec.multilingual:
        rows[0] = _id(tokenizer, f"<|{spec.language}|>")  # language detection's answer
    embedding = weights["decoder.token_embedding.weight"]
    positions = mx.zeros((spec.n_text_ctx, spec.n_state))
    for position, token in rows.items():
        positions[position] = embedding[token] * SCRIPT_SCALE
    weights["decoder.positional_embedding"] = positions


def _id(tokenizer: Tokenizer, token: str) -> int:
    found = tokenizer.token_to_id(token)
    if found is None:
        raise RuntimeError(f"{token} is not in the vocabulary")
    return int(found)


# --- build -------------------------------------------------------------------------------------


def _validate(spec: TinyWhisperSpec) -> None:
    if min(spec.n_state, spec.n_head, spec.n_layer, spec.n_mels) < 1:
        raise ValueError("sizes must be positive")
    if spec.n_state % spec.n_head:
        raise ValueError("n_state must divide by n_head")
    if spec.language not in language_codes():
        raise ValueError(f"unknown language {spec.language!r}")
    if not 0 < spec.script_end <= (TIMESTAMPS - 1) * TIME_STEP:
        raise ValueError("script_end must be within a 30 s window")


def build_tiny_whisper(
    out_dir: str | Path,
    seed: int = 0,
    scripted: bool = True,
    *,
    spec: TinyWhisperSpec = DEFAULT_WHISPER_SPEC,
) -> Path:
    """Write a Whisper model that `mlx_audio.stt.load` loads into `out_dir`; returns it.

    The folder is created; existing files are overwritten. The same arguments give
    byte-identical files. `scripted`: it says spec.script (else random weights: gibberish,
    usually until the token limit)."""
    import mlx.core as mx

    _validate(spec)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(spec)
    config = _model_config(spec, seed, scripted)
    weights = _random_weights(config, seed)
    if scripted:
        script_len = len(tokenizer.encode(spec.script, add_special_tokens=False).ids)
        if script_len + 5 > spec.n_text_ctx // 2:  # mlx-audio samples n_text_ctx // 2 at most
            raise ValueError("the script is too long for n_text_ctx")
        _script(weights, spec, tokenizer)
    half = {name: w.astype(mx.float16) for name, w in weights.items()}
    mx.save_safetensors(str(out / "model.safetensors"), half, metadata={"format": "mlx"})
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(spec))
    _write_json(out / "preprocessor_config.json", _feature_config(spec))
    _write_json(out / "config.json", config)
    return out


# Bump when the generator or the demo's spec changes, so cached demo models are rebuilt.
STT_DEMO_VERSION = "v1"


def ensure_stt_demo() -> Path:
    """The embedded default's speech-to-text model (scripted), built once into the cache."""
    from worker.modelgen import cache_dir, ensure_built

    final = cache_dir() / "models" / f"demo-whisper-{STT_DEMO_VERSION}"
    return ensure_built(
        final,
        lambda tmp: build_tiny_whisper(tmp, seed=0, scripted=True),
        lambda path: all((path / name).is_file() for name in MODEL_FILES),
    )


# --- command line ------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    d = DEFAULT_WHISPER_SPEC
    p = argparse.ArgumentParser(
        prog="python -m worker.speech.stt_modelgen",
        description="Build a tiny Whisper model for mlx_audio (scripted: it says a fixed text).",
    )
    p.add_argument("out_dir", type=Path)
    p.add_argument("--random", action="store_true", help="random weights, not scripted")
    p.add_argument("--english", action="store_true", help="an English-only vocabulary")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--state", type=int, default=d.n_state)
    p.add_argument("--layers", type=int, default=d.n_layer)
    p.add_argument("--language", default=d.language, help="what a scripted model detects")
    p.add_argument("--script", default=d.script, help="what a scripted model says")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    spec = TinyWhisperSpec(
        n_state=args.state,
        n_layer=args.layers,
        multilingual=not args.english,
        language=args.language,
        script=args.script,
    )
    start = time.perf_counter()
    out = build_tiny_whisper(args.out_dir, args.seed, not args.random, spec=spec)
    elapsed = time.perf_counter() - start
    size_mb = (out / "model.safetensors").stat().st_size / 1e6
    what = "random" if args.random else f"says {spec.script.strip()!r}"
    print(f"built {out}: {count_parameters(out):,} parameters, {size_mb:.1f} MB, {what}, "
          f"{elapsed:.1f}s")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
