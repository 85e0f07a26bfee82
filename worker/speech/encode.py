"""A speech model's audio, encoded as it is made: float32 mono samples in, the next bytes
of one file out, so that every piece can go to the client at once and the pieces joined
are a valid file.

Every format comes out at 24 kHz mono, OpenAI's rate, whatever the model's own: pcm is raw
signed 16-bit little-endian samples (no header), wav the same behind a streaming header
whose sizes are unknown (0xFFFFFFFF, as OpenAI sends it), mp3 (LAME, 64 kb/s, no ID3 tag),
aac (ADTS frames, 64 kb/s), opus (Ogg Opus, 32 kb/s) and flac (its STREAMINFO says the
length is unknown). The compressed formats use PyAV's FFmpeg; a format whose encoder it
lacks is left out of `available_formats()`. A tempo other than 1 goes through FFmpeg's
atempo filter (the pitch is kept), resampling through aresample.
"""

from __future__ import annotations

import contextlib
import struct
from dataclasses import dataclass, field
from fractions import Fraction

import av
import numpy as np

OUTPUT_RATE = 24_000
FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")  # OpenAI's response_format values
DEFAULT_FORMAT = "mp3"  # OpenAI's default
MIN_TEMPO, MAX_TEMPO = 0.25, 4.0
_ATEMPO_RANGE = (0.5, 2.0)  # one atempo filter's; a chain of them reaches further


@dataclass(frozen=True, slots=True)
class _Codec:
    container: str
    codec: str
    bit_rate: int | None = None
    options: dict[str, str] = field(default_factory=dict)  # the muxer's


_CODECS = {
    "mp3": _Codec("mp3", "libmp3lame", 64_000, {"id3v2_version": "0", "write_xing": "0"}),
    "aac": _Codec("adts", "aac", 64_000),
    # pages of at most 100 ms, so that audio leaves the muxer soon after it is encoded
    "opus": _Codec("ogg", "libopus", 32_000, {"page_duration": "100000"}),
    "flac": _Codec("flac", "flac", None, {"metadata_header_padding": "0"}),
}


def available_formats() -> list[str]:
    """The formats this process can encode (pcm and wav always; the others where PyAV's
    FFmpeg has their encoder)."""
    codecs = av.codecs_available
    return [f for f in FORMATS if f not in _CODECS or _CODECS[f].codec in codecs]


def wav_header(sample_rate: int = OUTPUT_RATE) -> bytes:
    """A 16-bit mono PCM WAV header whose RIFF and data sizes are unknown (0xFFFFFFFF)."""
    unknown = 0xFFFFFFFF
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return (
        b"RIFF" + struct.pack("<I", unknown) + b"WAVE"
        + b"fmt " + struct.pack("<I", len(fmt)) + fmt
        + b"data" + struct.pack("<I", unknown)
    )  # fmt: skip


def pcm16(samples: np.ndarray) -> bytes:
    """float32 samples in [-1, 1] as signed 16-bit little-endian bytes (clipped)."""
    scaled = np.clip(samples, -1.0, 1.0) * 32767.0
    return np.rint(scaled).astype("<i2").tobytes()


class Encoder:
    """One response's audio: `add` the model's samples (float32 mono at `sample_rate`) as
    they come, then `finish`; each call returns the next bytes of the file (maybe none yet:
    codecs work in frames). `tempo` speeds the speech up (> 1) or slows it down, keeping
    its pitch. `samples` counts what went out at OUTPUT_RATE, `duration` in seconds."""

    def __init__(self, format: str, sample_rate: int, tempo: float = 1.0) -> None:
        if format not in FORMATS:
            raise ValueError(f"unknown audio format {format!r}; one of {', '.join(FORMATS)}")
        if not MIN_TEMPO <= tempo <= MAX_TEMPO:
            raise ValueError(f"tempo {tempo} is outside {MIN_TEMPO}..{MAX_TEMPO}")
        self.format = format
        self.samples = 0
        self._filter = (
            _Filter(sample_rate, tempo) if sample_rate != OUTPUT_RATE or tempo != 1.0 else None
        )
        self._muxer = _Muxer(_CODECS[format]) if format in _CODECS else None
        self._started = False
        self._finished = False

    @property
    def duration(self) -> float:
        return self.samples / OUTPUT_RATE

    def add(self, samples: np.ndarray) -> bytes:
        if self._finished:
            raise RuntimeError("the encoder has finished")
        audio = np.asarray(samples, dtype=np.float32).reshape(-1)
        if not audio.size:
            return b""
        chunks = self._filter.push(audio) if self._filter is not None else [audio]
        return self._encode(chunks, last=False)

    def finish(self) -> bytes:
        """The file's last bytes (a codec's buffered frames, a container's trailer)."""
        if self._finished:
            return b""
        chunks = self._filter.flush() if self._filter is not None else []
        out = self._encode(chunks, last=True)
        self._finished = True
        return out

    def close(self) -> None:
        """Drop what is left, unsent (an aborted response)."""
        self._finished = True
        if self._muxer is not None:
            self._muxer.close()

    def _encode(self, chunks: list[np.ndarray], last: bool) -> bytes:
        head = b""
        if not self._started:
            self._started = True
            head = wav_header() if self.format == "wav" else b""
        self.samples += sum(len(c) for c in chunks)
        if self._muxer is None:
            return head + b"".join(pcm16(c) for c in chunks)
        return head + self._muxer.encode(chunks, last)


class _Sink:
    """A write-only file for the muxer: not seekable, so nothing written is ever rewritten
    (the container's header stays as first written, fit for streaming)."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out = b"".join(self.parts)
        self.parts.clear()
        return out


class _Muxer:
    """A PyAV encoder and muxer writing into a _Sink, fed OUTPUT_RATE float32 chunks (PyAV
    cuts them into the codec's frame size and converts to its sample format)."""

    def __init__(self, codec: _Codec) -> None:
        self.sink = _Sink()
        self.container = av.open(self.sink, "w", format=codec.container, options=codec.options)
        stream = self.container.add_stream(codec.codec, rate=OUTPUT_RATE, layout="mono")
        assert isinstance(stream, av.AudioStream)
        self.stream = stream
        if codec.bit_rate is not None:
            self.stream.bit_rate = codec.bit_rate
        self.pts = 0

    def encode(self, chunks: list[np.ndarray], last: bool) -> bytes:
        for chunk in chunks:
            frame = av.AudioFrame.from_ndarray(chunk[None, :], format="flt", layout="mono")
            frame.sample_rate = OUTPUT_RATE
            frame.pts = self.pts
            frame.time_base = Fraction(1, OUTPUT_RATE)
            self.pts += len(chunk)
            self.container.mux(self.stream.encode(frame))
        if last:
            self.container.start_encoding()  # its header, even without audio
            self.container.mux(self.stream.encode(None))
            self.container.close()
        return self.sink.take()

    def close(self) -> None:
        with contextlib.suppress(av.FFmpegError):
            self.container.close()


class _Filter:
    """float32 mono at the model's rate -> atempo (a chain, each within 0.5..2) -> float32
    mono at OUTPUT_RATE, through one FFmpeg filter graph."""

    def __init__(self, sample_rate: int, tempo: float) -> None:
        self.rate = sample_rate
        self.pts = 0
        self.graph = av.filter.Graph()
        nodes = [self.graph.add_abuffer(sample_rate=sample_rate, format="flt", layout="mono")]
        nodes += [self.graph.add("atempo", f"{t:.6f}") for t in _atempo_chain(tempo)]
        out_format = f"sample_fmts=flt:channel_layouts=mono:sample_rates={OUTPUT_RATE}"
        nodes += [
            self.graph.add("aresample", str(OUTPUT_RATE)),
            self.graph.add("aformat", out_format),
            self.graph.add("abuffersink"),
        ]
        self.graph.link_nodes(*nodes)
        self.graph.configure()

    def push(self, audio: np.ndarray) -> list[np.ndarray]:
        frame = av.AudioFrame.from_ndarray(audio[None, :], format="flt", layout="mono")
        frame.sample_rate = self.rate
        frame.pts = self.pts
        frame.time_base = Fraction(1, self.rate)
        self.pts += len(audio)
        self.graph.push(frame)
        return self._pull()

    def flush(self) -> list[np.ndarray]:
        self.graph.push(None)
        return self._pull()

    def _pull(self) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        while True:
            try:
                frame = self.graph.pull()
            except (av.error.BlockingIOError, av.error.EOFError):
                return out
            out.append(frame.to_ndarray().reshape(-1).astype(np.float32, copy=False))


def _atempo_chain(tempo: float) -> list[float]:
    """Factors within atempo's range whose product is `tempo` (none for 1)."""
    low, high = _ATEMPO_RANGE
    factors = []
    while tempo > high:
        factors.append(high)
        tempo /= high
    while tempo < low:
        factors.append(low)
        tempo /= low
    if abs(tempo - 1.0) > 1e-9:
        factors.append(tempo)
    return factors
