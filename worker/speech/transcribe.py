"""A speech-to-text model's worker parts (mlx-audio's Whisper): the preprocessor that checks a
transcription or translation request and decodes its audio on the input thread, and the
engine that transcribes. The same engine interface as the text engine, for the worker
process around it.

mlx-audio's Whisper transcribes a whole file per call (30 s windows, one after another, each
conditioned on the text before), so requests are transcribed one at a time, each whole in
one engine step: interactive requests before batch ones, first come first served within a
priority. An abort reaches a request while it waits; one being transcribed finishes first.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from shared.config import EngineOptions, ModelConfig
from shared.protocol import Add
from shared.types import (
    ErrorCode,
    FinishReason,
    Priority,
    RequestError,
    RequestKind,
    RequestOutput,
    Segment,
    Timings,
    Usage,
    Word,
)
from worker.loader import LoadError
from worker.preprocess import PreprocessError
from worker.speech.audio import SAMPLE_RATE, decode_audio

log = logging.getLogger("worker")

# The longest audio a request may hold. A constant: one hour, about what OpenAI's 25 MB
# upload limit holds as 64 kbit/s MP3 (decoded: 230 MB of samples).
MAX_AUDIO_SECONDS = 3600.0
# Waiting requests hold their decoded audio: beyond this much in all (about 1 GB), another
# request is refused as overloaded (the first always goes in).
MAX_WAITING_AUDIO_SECONDS = 4 * 3600.0
TIMESTAMPS = ("segment", "word")
# Whisper's fallback: a window decoded at one temperature that looks like a failure (too
# repetitive, too unlikely) is decoded again at the next, up to 1.0 (as OpenAI's whisper).
TEMPERATURE_STEP = 0.2


@dataclass(slots=True)
class PreparedTranscription:
    """A transcription or translation request, its audio decoded (16 kHz mono float32)."""

    request_id: str
    audio: np.ndarray
    duration: float  # seconds of audio
    task: str = "transcribe"  # or "translate" (to English)
    language: str | None = None  # a Whisper language code; None: detected
    initial_prompt: str | None = None  # text before the audio (style, vocabulary)
    temperature: float = 0.0  # the first of the fallback temperatures
    seed: int | None = None
    segments: bool = False  # report segments (timestamps "segment" or "word")
    words: bool = False  # and the words in them
    priority: int = 0
    received_at: float = 0.0
    prepared_at: float = 0.0


@dataclass(slots=True)
class _Backend:
    """What the worker process reads of a backend."""

    device: str
    batcher: str = "transcription"

    def release_memory(self) -> None:
        mx.clear_cache()


@dataclass(frozen=True, slots=True)
class Languages:
    """The languages a Whisper model knows: codes in token order, and names to codes."""

    codes: tuple[str, ...]
    names: dict[str, str] = field(default_factory=dict)
    multilingual: bool = True

    @staticmethod
    def of(model: Any) -> Languages:
        from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES, TO_LANGUAGE_CODE

        if not model.is_multilingual:
            return Languages(("en",), {"english": "en"}, multilingual=False)
        codes = tuple(list(LANGUAGES)[: model.num_languages])
        names = {name: code for name, code in TO_LANGUAGE_CODE.items() if code in codes}
        return Languages(codes, names)

    def code(self, language: str) -> str | None:
        """The code of a language given by code or English name ("de", "German"), or None."""
        key = language.strip().lower()
        return key if key in self.codes else self.names.get(key)


class TranscriptionPreprocessor:
    """Add frame -> PreparedTranscription, its audio decoded; a 400 naming the field for
    anything the model cannot do."""

    def __init__(self, languages: Languages, max_seconds: float = MAX_AUDIO_SECONDS) -> None:
        self.languages = languages
        self.max_seconds = max_seconds

    def __call__(self, frame: Add) -> PreparedTranscription:
        if frame.kind not in (RequestKind.TRANSCRIPTION, RequestKind.TRANSLATION):
            raise _invalid(
                "this model serves /v1/audio/transcriptions and /v1/audio/translations, "
                f"not {frame.kind} requests",
                "model",
            )
        translate = frame.kind == RequestKind.TRANSLATION
        if translate and not self.languages.multilingual:
            raise _invalid("this model is English-only: it does not translate", "model")
        request = frame.request
        language = self._language(request.language)
        temperature = frame.sampling.temperature
        if not 0.0 <= temperature <= 1.0:  # NaN too
            raise _invalid(f"temperature is {temperature}; it must be 0 to 1", "temperature")
        unknown = [t for t in request.timestamps if t not in TIMESTAMPS]
        if unknown:
            raise _invalid(
                f"unknown timestamp granularity {unknown[0]!r}: use 'segment' or 'word'",
                "timestamp_granularities",
            )
        if request.audio is None:
            raise _invalid("the request has no audio file", "file")
        audio = decode_audio(request.audio.data, self.max_seconds, request.audio.format)
        return PreparedTranscription(
            frame.request_id,
            audio.samples,
            audio.duration,
            task="translate" if translate else "transcribe",
            language=language,
            initial_prompt=request.prompt or None,
            temperature=temperature,
            seed=frame.sampling.seed,
            segments=bool(request.timestamps),
            words="word" in request.timestamps,
            priority=frame.priority,
        )

    def _language(self, language: str | None) -> str | None:
        if not language:
            return None
        code = self.languages.code(language)
        if code is not None:
            return code
        if not self.languages.multilingual:
            raise _invalid(f"this model is English-only; it does not hear {language!r}", "language")
        raise _invalid(
            f"unknown language {language!r}: give an ISO-639-1 code Whisper knows (en, de, "
            "fr, ...)",
            "language",
        )


class TranscriptionEngine:
    """Whisper's requests, transcribed one at a time (see the module's docstring)."""

    def __init__(
        self,
        model: Any,
        options: EngineOptions,
        max_waiting_audio_s: float = MAX_WAITING_AUDIO_SECONDS,
    ) -> None:
        self.model = model
        # the gateway keeps at most this many requests in a worker: a backstop
        self.capacity = max(1, options.max_running + options.max_waiting)
        self.max_waiting_audio_s = max_waiting_audio_s
        self.waiting: dict[str, PreparedTranscription] = {}
        self.queues: dict[int, deque[str]] = {p: deque() for p in Priority}
        self.running: str | None = None  # the request being transcribed (during a step)
        self._steps = 0
        self._busy: tuple[float, float] | None = None  # (started, counted until): see steps
        self.backend = _Backend("cpu" if mx.default_device() == mx.cpu else "gpu")
        self.prefix_cache = None

    # ---- the worker's interface -------------------------------------------------------

    def add(self, prepared: PreparedTranscription) -> RequestOutput | None:
        if prepared.request_id in self.waiting:
            raise ValueError(f"request {prepared.request_id} is already waiting")
        queued = sum(p.duration for p in self.waiting.values())
        full = len(self.waiting) >= self.capacity
        if full or (self.waiting and queued + prepared.duration > self.max_waiting_audio_s):
            message = f"{len(self.waiting)} transcriptions ({queued:.0f} s of audio) are waiting"
            error = RequestError(ErrorCode.OVERLOADED, message)
            return RequestOutput(prepared.request_id, finish_reason=FinishReason.ERROR, error=error)
        self.waiting[prepared.request_id] = prepared
        self.queues[min(max(prepared.priority, 0), Priority.BATCH)].append(prepared.request_id)
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting)

    can_step = has_work  # (nothing of theirs waits on another thread)

    @property
    def steps(self) -> int:
        """Steps taken. While one request is transcribed (one call, however long its audio)
        the count also goes up a second at a time, up to twice the audio's length plus a
        minute: the gateway's liveness check sees a worker at work, and one stuck for longer
        than that as wedged (read by the heartbeat thread)."""
        busy = self._busy
        if busy is None:
            return self._steps
        started, until = busy
        return self._steps + int(max(0.0, min(time.monotonic(), until) - started))

    def step(self) -> list[RequestOutput]:
        """The next waiting request, transcribed whole (one at a time: see the module)."""
        self._steps += 1
        prepared = self._take()
        if prepared is None:
            return []
        self.running = prepared.request_id
        now = time.monotonic()
        self._busy = (now, now + 2 * prepared.duration + 60)
        try:
            return [self._transcribe(prepared)]
        finally:
            self._steps, self._busy = self.steps, None
            self.running = None

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        gone = [rid for rid in request_ids if self.waiting.pop(rid, None) is not None]
        for priority, queue in self.queues.items():
            self.queues[priority] = deque(rid for rid in queue if rid in self.waiting)
        return [RequestOutput(rid, finish_reason=FinishReason.ABORT) for rid in gone]

    def request_ids(self) -> list[str]:
        running = self.running
        return [*([running] if running is not None else []), *list(self.waiting)]

    def counts(self) -> tuple[int, int]:
        """(requests being transcribed: 0 or 1, requests waiting)."""
        # read by the output and input threads while the engine adds and removes
        return (0 if self.running is None else 1), len(self.waiting)

    def prefix_stats(self) -> None:
        return None

    def settle(self) -> None:
        """Nothing a step puts off here."""

    def probe(self, prepared: PreparedTranscription | None = None) -> None:
        """Ready means ready: one second of silence (or `prepared`) through the model."""
        audio = prepared.audio if prepared is not None else np.zeros(SAMPLE_RATE, np.float32)
        result = self.model.generate(audio, temperature=0.0)
        if not isinstance(result.text, str):
            raise RuntimeError(f"the model's transcription is {type(result.text).__name__}")

    # ---- one request ------------------------------------------------------------------

    def _take(self) -> PreparedTranscription | None:
        for priority in sorted(self.queues):
            queue = self.queues[priority]
            while queue:
                prepared = self.waiting.pop(queue.popleft(), None)
                if prepared is not None:
                    return prepared
        return None

    def _transcribe(self, prepared: PreparedTranscription) -> RequestOutput:
        """The request's one terminal output: its text, or an error of its own (the engine
        keeps serving the others)."""
        started = time.perf_counter()
        rid = prepared.request_id
        try:
            if prepared.seed is not None:
                mx.random.seed(prepared.seed)
            result = self.model.generate(
                prepared.audio,
                language=prepared.language,
                task=prepared.task,
                initial_prompt=prepared.initial_prompt,
                temperature=_temperatures(prepared.temperature),
                word_timestamps=prepared.words,
            )
            segments = [_segment(s, prepared.words) for s in result.segments or []]
        except Exception as exc:  # the model failed on this request: it alone fails
            log.warning("request %s: transcription failed: %r", rid, exc, extra={"request_id": rid})
            error = RequestError(ErrorCode.INTERNAL, f"the transcription failed: {exc}")
            return RequestOutput(rid, finish_reason=FinishReason.ERROR, error=error)
        now = time.perf_counter()
        received = prepared.received_at or started
        prepared_at = prepared.prepared_at or received
        return RequestOutput(
            rid,
            text=str(result.text).strip(),
            finish_reason=FinishReason.STOP,
            usage=Usage(completion_tokens=sum(len(s.tokens) for s in segments)),
            timings=Timings(prepared_at - received, started - prepared_at, now - started),
            segments=segments if prepared.segments else [],
            language=result.language or prepared.language,
            duration=prepared.duration,
        )


def _temperatures(first: float) -> tuple[float, ...]:
    """first, first + 0.2, ... up to 1.0: Whisper's fallback schedule from `first`."""
    steps = math.floor((1.0 - first) / TEMPERATURE_STEP + 1e-6)
    return tuple(round(first + i * TEMPERATURE_STEP, 6) for i in range(steps + 1))


def _segment(raw: dict[str, Any], words: bool) -> Segment:
    """A segment as mlx-audio's Whisper gives it (OpenAI's verbose_json fields)."""
    found = [
        Word(str(w["word"]).strip(), _finite(w["start"]), _finite(w["end"]))
        for w in (raw.get("words") or [] if words else [])
    ]
    return Segment(
        int(raw["id"]),
        _finite(raw["start"]),
        _finite(raw["end"]),
        str(raw["text"]),
        tokens=[int(t) for t in raw.get("tokens") or []],
        temperature=_finite(raw.get("temperature", 0.0)),
        avg_logprob=_finite(raw.get("avg_logprob", 0.0)),
        compression_ratio=_finite(raw.get("compression_ratio", 0.0)),
        no_speech_prob=_finite(raw.get("no_speech_prob", 0.0)),
        words=found,
    )


def _finite(value: Any) -> float:
    """A float JSON can carry: a NaN or infinite statistic (a window with no text token
    averages nothing) is reported as 0."""
    number = float(value)
    return number if math.isfinite(number) else 0.0


def open_transcriber(
    config: ModelConfig, path: Path
) -> tuple[TranscriptionEngine, TranscriptionPreprocessor, list[str]]:
    """The engine and the preprocessor of the Whisper model at `path`, and what it serves:
    transcription, and translation when it is multilingual."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder: nothing to fetch
    from mlx_audio.stt import load
    from mlx_audio.stt.models.whisper.whisper import Model as Whisper

    try:
        model = load(Path(path))
    except Exception as exc:  # mlx-audio raises what its model's loader raises
        raise LoadError(f"model {config.name!r}: cannot load {path}: {exc}") from exc
    if not isinstance(model, Whisper):
        raise LoadError(
            f"model {config.name!r}: {path} is a {type(model).__name__} (mlx-audio's); only "
            "Whisper models transcribe here"
        )
    try:
        vocab = model.get_tokenizer().hf_tokenizer.get_vocab()
    except ValueError as exc:  # no processor: WhisperProcessor could not load the folder
        raise LoadError(f"model {config.name!r}: {path}: {exc}") from exc
    if not {"<|startoftranscript|>", "<|0.00|>"} <= vocab.keys():
        raise LoadError(
            f"model {config.name!r}: {path} has no Whisper tokenizer (tokenizer.json, or "
            "vocab.json and merges.txt, with Whisper's special tokens)"
        )
    languages = Languages.of(model)
    served = ["transcription", *(["translation"] if languages.multilingual else [])]
    preprocess = TranscriptionPreprocessor(languages)
    return TranscriptionEngine(model, config.engine), preprocess, served


def _invalid(message: str, param: str | None = None) -> PreprocessError:
    return PreprocessError(RequestError(ErrorCode.INVALID_REQUEST, message, param))
