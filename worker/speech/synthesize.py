"""Text to speech: a speech model's worker parts (an mlx-audio TTS model), as the worker
drives every kind's engine (worker/opening.py `Engine`).

A request's text is cut into sentences (short ones joined) and each sentence generated in
turn with mlx-audio's `generate`: streamed in chunks of about STREAMING_INTERVAL_S of audio
where the model streams, else whole. A step pulls the next chunk of every running request
(at most engine.max_running, starting with a different one each step), encodes it
(worker/speech/encode.py) and returns its bytes: concurrent requests progress together,
though the model itself is not batched (each pull runs one request's generation alone).
mlx-audio models keep their streaming state on the model (Qwen3-TTS: its vocoder's conv
buffers and KV cache), so one sentence at a time streams: the sentences of the other
requests running meanwhile are generated whole. Each request owns its random state
(restored before each of its pulls, saved after), so a seed gives the same audio whatever
else runs and whether its sentences streamed.

Audio leaves at 24 kHz (encode.OUTPUT_RATE) in every format; `speed` is the model's own
where it honours one (duration-predicting models), else FFmpeg's atempo (pitch kept).
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import re
import secrets
import time
from collections import deque
from collections.abc import Iterator
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
    SamplingParams,
    Timings,
    Usage,
)
from worker.loader import LoadError
from worker.preprocess import PreprocessError
from worker.speech.encode import (
    DEFAULT_FORMAT,
    FORMATS,
    MAX_TEMPO,
    MIN_TEMPO,
    Encoder,
    available_formats,
)

log = logging.getLogger("worker")

MAX_INPUT_CHARS = 4096  # OpenAI's limit on `input`
STREAMING_INTERVAL_S = 0.64  # audio in a streamed chunk (mlx-audio's default: 2 s)
MIN_SENTENCE_CHARS = 40  # shorter sentences are generated with the next one
# model_type values whose `speed` shortens or stretches predicted durations (others take
# the argument and ignore it: Qwen3-TTS's says "not directly supported yet")
NATIVE_SPEED = frozenset({"kokoro", "kitten_tts"})
# after . ! ? ; and a space, after the ideographic full stop and full-width ! ?, at a line break
_SENTENCE_END = re.compile(r"(?<=[.!?;])\s+|(?<=[\u3002\uff01\uff1f])\s*|\s*\n\s*")
_DEFAULT_TEMPERATURE = SamplingParams().temperature


@dataclass(slots=True)
class PreparedSpeech:
    """A speech request, validated. `temperature` None: the model's own default."""

    request_id: str
    text: str
    voice: str | None = None
    speed: float = 1.0
    format: str = DEFAULT_FORMAT
    temperature: float | None = None
    seed: int | None = None
    priority: int = 0
    received_at: float = 0.0
    prepared_at: float = 0.0
    prompt: list[int] = field(default_factory=list)  # the text's token ids, where known


def sentences(text: str, min_chars: int = MIN_SENTENCE_CHARS) -> list[str]:
    """The text's sentences and lines, each joined to the next while shorter than
    `min_chars`."""
    out: list[str] = []
    for piece in (p.strip() for p in _SENTENCE_END.split(text)):
        if not piece:
            continue
        if out and len(out[-1]) < min_chars:
            out[-1] += " " + piece
        else:
            out.append(piece)
    return out


class SpeechModel:
    """An mlx-audio TTS model as the engine uses it: its voices, rate and generation."""

    def __init__(self, model: Any, model_type: str = "") -> None:
        self.model = model
        self.model_type = model_type
        self.sample_rate = int(model.sample_rate)
        self.voices = _voices(model)
        self.default_voice = self.voices[0] if self.voices else None
        params = inspect.signature(model.generate).parameters
        self._takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        self._params = set(params)
        self.takes_voice = "voice" in params  # by name: a voice it may refuse itself
        self.streams = "stream" in params
        self.native_speed = model_type in NATIVE_SPEED
        tokenizer = getattr(model, "tokenizer", None)
        self.tokenizer = tokenizer if callable(getattr(tokenizer, "encode", None)) else None

    def tokens(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text)) if self.tokenizer is not None else []

    def generate(
        self, text: str, request: PreparedSpeech, stream: bool, interval: float
    ) -> Iterator[Any]:
        """mlx-audio's generator of GenerationResults for `text`, in the request's voice."""
        kwargs: dict[str, Any] = {"voice": request.voice, "verbose": False}
        if stream:
            kwargs |= {"stream": True, "streaming_interval": interval}
        if request.temperature is not None:
            kwargs["temperature"] = request.temperature
        if self.native_speed:
            kwargs["speed"] = request.speed
        if not self._takes_any:
            kwargs = {k: v for k, v in kwargs.items() if k in self._params}
        return iter(self.model.generate(text, **kwargs))

    def tempo(self, speed: float) -> float:
        """What the encoder's atempo does of a request's speed (1: the model did it)."""
        return 1.0 if self.native_speed else speed


def _voices(model: Any) -> list[str]:
    speakers = getattr(model, "get_supported_speakers", None)
    try:
        return [str(v) for v in speakers()] if callable(speakers) else []
    except Exception:  # a model without a speaker table
        return []


class SpeechPreprocessor:
    """Add frame -> PreparedSpeech (on the input thread): the input, voice, speed and
    format checked, the input tokenized where the model has a tokenizer."""

    def __init__(
        self, model: SpeechModel, options: EngineOptions, formats: list[str] | None = None
    ) -> None:
        self.model = model
        self.voices = {v.lower(): v for v in model.voices}
        self.formats = formats if formats is not None else available_formats()
        self.max_prompt_tokens = options.max_prompt_tokens

    def __call__(self, frame: Add) -> PreparedSpeech:
        if frame.kind != RequestKind.SPEECH:
            raise _invalid(
                f"this model serves /v1/audio/speech, not {frame.kind} requests", "model"
            )
        request, sampling = frame.request, frame.sampling
        text = request.prompt or ""
        if not text.strip():
            raise _invalid("`input` is empty", "input")
        if len(text) > MAX_INPUT_CHARS:
            raise _invalid(
                f"`input` has {len(text)} characters; at most {MAX_INPUT_CHARS}", "input"
            )
        prompt = self.model.tokens(text)
        limit = self.max_prompt_tokens
        if limit is not None and len(prompt) > limit:
            raise _invalid(
                f"`input` has {len(prompt)} tokens; this gateway accepts at most {limit} "
                "(max_prompt_tokens)",
                "input",
            )
        temperature = sampling.temperature
        if not math.isfinite(temperature) or temperature < 0:
            raise _invalid(f"temperature {temperature} is not a number >= 0", "temperature")
        return PreparedSpeech(
            frame.request_id,
            text,
            self._voice(request.voice),
            self._speed(request.speed),
            self._format(request.audio_format),
            None if temperature == _DEFAULT_TEMPERATURE else temperature,
            sampling.seed,
            frame.priority,
            prompt=prompt,
        )

    def _voice(self, voice: str | None) -> str | None:
        if not voice or (not self.voices and voice.lower() == "default"):
            return self.model.default_voice
        if not self.voices:  # the model names none: one that takes a voice judges it
            if self.model.takes_voice:
                return voice
            raise _invalid(
                "this model speaks in one voice: leave voice out (or 'default')", "voice"
            )
        found = self.voices.get(voice.lower())
        if found is None:
            raise _invalid(
                f"voice {voice!r} is not one of this model's: {', '.join(self.model.voices)}",
                "voice",
            )
        return found

    def _speed(self, speed: float | None) -> float:
        if speed is None:
            return 1.0
        if not (math.isfinite(speed) and MIN_TEMPO <= speed <= MAX_TEMPO):
            raise _invalid(f"speed {speed} is not between {MIN_TEMPO} and {MAX_TEMPO}", "speed")
        return float(speed)

    def _format(self, format: str | None) -> str:
        format = (format or DEFAULT_FORMAT).lower()
        if format not in FORMATS:
            raise _invalid(
                f"response_format {format!r} is not one of {', '.join(FORMATS)}",
                "response_format",
            )
        if format not in self.formats:
            raise _invalid(
                f"{format} is not available (this worker's FFmpeg has no {format} encoder); "
                f"use one of {', '.join(self.formats)}",
                "response_format",
            )
        return format


def _invalid(message: str, param: str | None = None) -> PreprocessError:
    return PreprocessError(RequestError(ErrorCode.INVALID_REQUEST, message, param))


@dataclass(slots=True, eq=False)
class _Running:
    request: PreparedSpeech
    encoder: Encoder
    sentences: deque[str]
    rng: int  # its MLX random state: the key's two words as one int (mx.random.seed(rng))
    started_at: float
    chunks: Iterator[Any] | None = None  # the current sentence's generator
    tokens: int = 0  # audio tokens (codec frames) made, where the model counts them
    answered: bool = False  # an output went out (the first carries the timings)
    done: bool = False


@dataclass(slots=True)
class _Backend:
    """What the worker process reads of a backend."""

    device: str
    batcher: str = "speech"

    def release_memory(self) -> None:
        mx.clear_cache()


class SpeechEngine:
    def __init__(
        self,
        model: SpeechModel,
        options: EngineOptions,
        streaming_interval: float = STREAMING_INTERVAL_S,
    ) -> None:
        self.model = model
        self.voices = model.voices  # for the gateway's errors and model listing
        self.max_running = max(1, options.max_running)
        self.streaming_interval = streaming_interval
        self.running: list[_Running] = []
        self.waiting: dict[int, deque[PreparedSpeech]] = {p: deque() for p in Priority}
        self.streamer: _Running | None = None  # whose sentence holds the streaming state
        self.steps = 0
        self.backend = _Backend("cpu" if mx.default_device() == mx.cpu else "gpu")
        self.prefix_cache = None
        self._turn = 0

    # ---- the worker's interface -------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.running) or any(self.waiting.values())

    can_step = has_work  # (nothing of theirs waits on another thread)

    def add(self, prepared: PreparedSpeech) -> RequestOutput | None:
        if not prepared.text.strip():
            raise ValueError("the request has no input")
        if prepared.request_id in self.request_ids():
            raise ValueError(f"request {prepared.request_id} is already running")
        self.waiting[min(max(prepared.priority, 0), Priority.BATCH)].append(prepared)
        return None

    def step(self) -> list[RequestOutput]:
        """The next chunk of every running request, encoded; finished requests' last bytes."""
        self.steps += 1
        self._admit()
        if not self.running:
            return []
        first = self._turn % len(self.running)
        self._turn += 1
        outputs = []
        for run in self.running[first:] + self.running[:first]:
            output = self._advance(run)
            if output is not None:
                outputs.append(output)
        self.running = [run for run in self.running if not run.done]
        return outputs

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        gone = set(request_ids)
        ended = [p.request_id for q in self.waiting.values() for p in q if p.request_id in gone]
        for priority, queue in self.waiting.items():
            self.waiting[priority] = deque(p for p in queue if p.request_id not in gone)
        for run in self.running:
            if run.request.request_id in gone:
                self._drop(run)
                ended.append(run.request.request_id)
        self.running = [run for run in self.running if not run.done]
        return [RequestOutput(rid, finish_reason=FinishReason.ABORT) for rid in ended]

    def request_ids(self) -> list[str]:
        waiting = [p.request_id for queue in list(self.waiting.values()) for p in list(queue)]
        return [run.request.request_id for run in list(self.running)] + waiting

    def counts(self) -> tuple[int, int]:
        """(requests generating, requests waiting for a place); read from other threads."""
        return len(self.running), sum(len(q) for q in list(self.waiting.values()))

    def prefix_stats(self) -> None:
        return None

    def settle(self) -> None:
        """Nothing a step puts off here."""

    def probe(self, prepared: PreparedSpeech | None = None) -> None:
        """Ready means ready: a short text through the engine into wav, some audio."""
        request = prepared or PreparedSpeech(
            "probe", "Hello.", self.model.default_voice, format="wav"
        )
        self.add(request)
        outputs: list[RequestOutput] = []
        while self.has_work:
            outputs += self.step()
        last = outputs[-1] if outputs else None
        if last is None or last.finish_reason is not FinishReason.STOP:
            error = last.error.message if last is not None and last.error else "no output"
            raise RuntimeError(f"the probe's speech failed: {error}")
        if not last.duration:
            raise RuntimeError("the probe's speech has no audio")

    # ---- requests ---------------------------------------------------------------------

    def _admit(self) -> None:
        for priority in sorted(self.waiting):
            queue = self.waiting[priority]
            while queue and len(self.running) < self.max_running:
                self.running.append(self._start(queue.popleft()))

    def _start(self, request: PreparedSpeech) -> _Running:
        encoder = Encoder(request.format, self.model.sample_rate, self.model.tempo(request.speed))
        seed = request.seed if request.seed is not None else secrets.randbits(64)
        parts = deque(sentences(request.text) or [request.text.strip()])
        return _Running(request, encoder, parts, seed % 2**64, time.perf_counter())

    def _advance(self, run: _Running) -> RequestOutput | None:
        """One chunk of the request's audio, encoded (None while the codec holds it); its
        last bytes once it has no more. A failure fails this request alone."""
        try:
            audio = self._pull(run)
            if audio is None:
                return self._finish(run)
            data = run.encoder.add(audio)
        except Exception as exc:  # the model's or the encoder's: this request only
            rid = run.request.request_id
            log.warning("speech request %s failed", rid, exc_info=True, extra={"request_id": rid})
            self._drop(run)
            error = RequestError(ErrorCode.INTERNAL, f"speech generation failed: {exc}")
            return RequestOutput(rid, finish_reason=FinishReason.ERROR, error=error)
        if not data:
            return None
        return self._output(run, RequestOutput(run.request.request_id, audio=data))

    def _pull(self, run: _Running) -> np.ndarray | None:
        """The request's next samples (float32 mono at the model's rate), starting its next
        sentence as one ends; None when it has none left."""
        while True:
            if run.chunks is None:
                if not run.sentences:
                    return None
                stream = self.model.streams and self.streamer in (None, run)
                self.streamer = run if stream else self.streamer
                text = run.sentences.popleft()
                run.chunks = self.model.generate(text, run.request, stream, self.streaming_interval)
            mx.random.seed(run.rng)
            try:
                result = next(run.chunks, None)
            finally:
                run.rng = _random_state()
            if result is None:
                self._end_sentence(run)
                continue
            run.tokens += int(getattr(result, "token_count", 0) or 0)
            audio = np.asarray(result.audio).astype(np.float32, copy=False).reshape(-1)
            if not np.isfinite(audio).all():
                raise RuntimeError("the model made non-finite audio")
            if audio.size:
                return audio

    def _end_sentence(self, run: _Running) -> None:
        if run.chunks is not None:
            close = getattr(run.chunks, "close", None)
            run.chunks = None
            if close is not None:
                close()
        if self.streamer is run:
            self.streamer = None

    def _finish(self, run: _Running) -> RequestOutput:
        request = run.request
        data = run.encoder.finish()
        run.done = True
        self._end_sentence(run)
        output = RequestOutput(
            request.request_id,
            audio=data,
            finish_reason=FinishReason.STOP,
            duration=run.encoder.duration,
            usage=Usage(prompt_tokens=len(request.prompt), completion_tokens=run.tokens),
        )
        return self._output(run, output)

    def _output(self, run: _Running, output: RequestOutput) -> RequestOutput:
        """The first output of a request carries where its time went before it."""
        if not run.answered:
            run.answered = True
            request = run.request
            received = request.received_at or run.started_at
            prepared = request.prepared_at or received
            output.timings = Timings(
                prepared - received,
                max(run.started_at - prepared, 0.0),
                time.perf_counter() - run.started_at,
            )
        return output

    def _drop(self, run: _Running) -> None:
        """An aborted or failed request: its generator closed, its encoder discarded."""
        run.done = True
        try:
            self._end_sentence(run)
        finally:
            run.encoder.close()


def _random_state() -> int:
    """MLX's random key as the int whose mx.random.seed makes that key again."""
    state: Any = mx.random.state
    hi, lo = state[0].tolist()
    return int(hi) << 32 | int(lo)


def open_synthesizer(
    config: ModelConfig, path: Path
) -> tuple[SpeechEngine, SpeechPreprocessor, list[str]]:
    """The engine, the preprocessor and the capabilities of the TTS model at `path` (a
    local folder: mlx-audio never reaches the network from here)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from mlx_audio.tts.utils import load_model

    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
        model = load_model(path)
    except Exception as exc:  # mlx-audio raises whatever its model's code does
        raise LoadError(f"model {config.name!r}: cannot load {path}: {exc}") from exc
    speech = SpeechModel(model, str(raw.get("model_type") or ""))
    if not speech.voices and (path / "voices").is_dir():  # Kokoro's: a file per voice
        speech.voices = sorted({f.stem for f in (path / "voices").iterdir() if f.is_file()})
        speech.default_voice = speech.voices[0] if speech.voices else None
    if speech.sample_rate <= 0:
        raise LoadError(f"model {config.name!r}: {path} has no sample rate")
    engine = SpeechEngine(speech, config.engine)
    return engine, SpeechPreprocessor(speech, config.engine), ["speech"]
