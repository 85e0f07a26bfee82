"""A transcript in each of OpenAI's response formats: json, text, srt, vtt and verbose_json.
Pure functions of what the worker heard: its text, its timed segments (with their words),
the language and the audio's duration."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field

import msgspec

from gateway.api.audio.languages import language_name
from shared.types import Segment

FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
JSON = "application/json"
MEDIA_TYPES = {
    "json": JSON,
    "verbose_json": JSON,
    "text": "text/plain",
    "srt": "text/plain",
    "vtt": "text/vtt",
}
TIMED = frozenset({"srt", "vtt", "verbose_json"})  # formats made from segments


@dataclass(slots=True)
class Transcript:
    text: str
    segments: list[Segment] = field(default_factory=list)
    language: str | None = None  # as the worker says it: a code ("en") or a name
    duration: float | None = None  # seconds of audio heard

    @property
    def seconds(self) -> float:
        """The audio's duration; without one from the worker, the end of its last segment."""
        if self.duration is not None:
            return self.duration
        return self.segments[-1].end if self.segments else 0.0


class DurationUsage(msgspec.Struct):
    seconds: int
    type: str = "duration"


class TextBody(msgspec.Struct, omit_defaults=True):
    """response_format json."""

    text: str
    usage: DurationUsage | None = None


class VerboseSegment(msgspec.Struct):
    id: int
    seek: int  # where the segment starts, in 10 ms frames (Whisper's unit)
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float


class VerboseWord(msgspec.Struct):
    word: str
    start: float
    end: float


class VerboseBody(msgspec.Struct, omit_defaults=True):
    """response_format verbose_json."""

    task: str  # transcribe | translate
    language: str
    duration: float
    text: str
    segments: list[VerboseSegment] | None = None
    words: list[VerboseWord] | None = None
    usage: DurationUsage | None = None


def render(
    transcript: Transcript, fmt: str, task: str, granularities: Collection[str] = ()
) -> bytes:
    """The body of `fmt` (one of FORMATS) for a transcription (task "transcribe") or a
    translation ("translate", whose bodies have no usage, as OpenAI's)."""
    usage = DurationUsage(math.ceil(transcript.seconds)) if task == "transcribe" else None
    if fmt == "text":
        return (transcript.text + "\n").encode()
    if fmt == "srt":
        return srt(transcript.segments).encode()
    if fmt == "vtt":
        return vtt(transcript.segments).encode()
    if fmt == "verbose_json":
        return msgspec.json.encode(verbose(transcript, task, granularities, usage))
    return msgspec.json.encode(TextBody(transcript.text, usage))


def verbose(
    transcript: Transcript, task: str, granularities: Collection[str], usage: DurationUsage | None
) -> VerboseBody:
    """Segments unless only words were asked for (as OpenAI), words when asked for."""
    segments = words = None
    if "segment" in granularities or "word" not in granularities:
        segments = [_segment(s) for s in transcript.segments]
    if "word" in granularities:
        words = [VerboseWord(w.word, w.start, w.end) for s in transcript.segments for w in s.words]
    return VerboseBody(
        task,
        language_name(transcript.language),
        transcript.seconds,
        transcript.text,
        segments,
        words,
        usage,
    )


def _segment(s: Segment) -> VerboseSegment:
    return VerboseSegment(
        s.id,
        round(s.start * 100),
        s.start,
        s.end,
        s.text,
        s.tokens,
        s.temperature,
        s.avg_logprob,
        s.compression_ratio,
        s.no_speech_prob,
    )


def timestamp(seconds: float, decimal: str) -> str:
    """HH:MM:SS,mmm (SubRip, decimal ",") or HH:MM:SS.mmm (WebVTT, ".")."""
    millis = max(0, round(seconds * 1000))
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal}{millis:03d}"


def srt(segments: list[Segment]) -> str:
    """SubRip: numbered cues from 1, each followed by a blank line."""
    return "".join(
        f"{n}\n{timestamp(s.start, ',')} --> {timestamp(s.end, ',')}\n{s.text.strip()}\n\n"
        for n, s in enumerate(segments, start=1)
    )


def vtt(segments: list[Segment]) -> str:
    """WebVTT: the header, then a cue per segment, each followed by a blank line."""
    cues = "".join(
        f"{timestamp(s.start, '.')} --> {timestamp(s.end, '.')}\n{s.text.strip()}\n\n"
        for s in segments
    )
    return "WEBVTT\n\n" + cues
