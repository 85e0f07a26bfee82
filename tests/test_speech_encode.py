"""The speech encoder: every format, fed in pieces at a model's rate, joins into one file that
FFmpeg decodes to the duration the encoder reports, at 24 kHz; wav has a streaming header,
pcm is bare 16-bit samples; bytes come out before the end; a tempo keeps the pitch."""

from __future__ import annotations

import io
import struct

import av
import numpy as np
import pytest

from worker.speech.encode import (
    FORMATS,
    OUTPUT_RATE,
    Encoder,
    _atempo_chain,
    available_formats,
    pcm16,
    wav_header,
)

# FFmpeg's decoders add the encoder's delay and padding (LAME and AAC): a frame or so
SLACK_S = {"mp3": 0.1, "aac": 0.1}


def tone(seconds: float, rate: int, hz: float = 300.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.4 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def encode(fmt: str, audio: np.ndarray, rate: int, tempo: float = 1.0, piece: int = 777):
    """The file's pieces as they came out, and the encoder."""
    encoder = Encoder(fmt, rate, tempo)
    parts = [encoder.add(audio[i : i + piece]) for i in range(0, len(audio), piece)]
    return [*parts, encoder.finish()], encoder


def decoded(data: bytes) -> tuple[np.ndarray, int, str]:
    """Samples at 24 kHz mono, the stream's own rate, the codec FFmpeg found."""
    with av.open(io.BytesIO(data), "r") as container:
        stream = container.streams.audio[0]
        resampler = av.AudioResampler(format="flt", layout="mono", rate=OUTPUT_RATE)
        out = []
        for frame in container.decode(stream):
            out += [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
        out += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]
        return np.concatenate(out), stream.sample_rate, stream.codec_context.name


def test_this_ffmpeg_encodes_every_format() -> None:
    assert available_formats() == list(FORMATS)


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "pcm"])
@pytest.mark.parametrize("rate", [2000, 22050, OUTPUT_RATE])
def test_each_format_decodes_to_the_duration_it_reports(fmt: str, rate: int) -> None:
    parts, encoder = encode(fmt, tone(1.0, rate), rate)
    assert encoder.duration == pytest.approx(1.0, abs=0.01)
    samples, stream_rate, codec = decoded(b"".join(parts))
    expected = {"mp3": "mp3float", "aac": "aac", "opus": "opus", "flac": "flac"}
    assert codec == expected.get(fmt, "pcm_s16le")
    assert stream_rate == (48000 if fmt == "opus" else OUTPUT_RATE)  # Opus decodes at 48k
    seconds = len(samples) / OUTPUT_RATE
    assert encoder.duration <= seconds + 0.005
    assert seconds <= encoder.duration + SLACK_S.get(fmt, 0.005)


@pytest.mark.parametrize("fmt", FORMATS)
def test_bytes_come_out_before_the_end(fmt: str) -> None:
    parts, _ = encode(fmt, tone(2.0, OUTPUT_RATE), OUTPUT_RATE, piece=OUTPUT_RATE // 2)
    assert all(parts[:-1]) and sum(map(len, parts[:-1])) > len(parts[-1])


def test_wav_has_a_streaming_header_then_its_samples() -> None:
    audio = tone(0.5, OUTPUT_RATE)
    parts, encoder = encode("wav", audio, OUTPUT_RATE)
    data = b"".join(parts)
    assert data[:44] == wav_header() and parts[0].startswith(data[:44])
    riff, riff_size, wave_, fmt_, fmt_size = struct.unpack("<4sI4s4sI", data[:20])
    assert (riff, riff_size, wave_, fmt_, fmt_size) == (b"RIFF", 0xFFFFFFFF, b"WAVE", b"fmt ", 16)
    pcm, channels, rate, byte_rate, align, bits = struct.unpack("<HHIIHH", data[20:36])
    assert (pcm, channels, rate, byte_rate, align, bits) == (1, 1, 24000, 48000, 2, 16)
    assert data[36:44] == b"data" + b"\xff\xff\xff\xff"
    assert data[44:] == pcm16(audio) and encoder.samples == len(audio)


def test_pcm_is_bare_16_bit_samples_at_24_khz() -> None:
    audio = tone(1.0, OUTPUT_RATE)
    parts, encoder = encode("pcm", audio, OUTPUT_RATE)
    data = b"".join(parts)
    assert data == pcm16(audio) and len(data) == 2 * OUTPUT_RATE == 2 * encoder.samples
    slow, slow_encoder = encode("pcm", tone(1.0, 8000), 8000)  # resampled to 24 kHz
    assert len(b"".join(slow)) == 2 * slow_encoder.samples
    assert slow_encoder.samples == pytest.approx(OUTPUT_RATE, abs=24)
    back = np.frombuffer(b"".join(slow), "<i2") / 32767
    assert np.abs(back[1000:-1000] - tone(1.0, OUTPUT_RATE)[1000:-1000]).max() < 0.02


def test_samples_are_clipped_to_full_scale() -> None:
    values = np.frombuffer(pcm16(np.array([-2.0, -1.0, 0.0, 0.5, 1.0, 3.0], np.float32)), "<i2")
    assert values.tolist() == [-32767, -32767, 0, 16384, 32767, 32767]


@pytest.mark.parametrize("tempo", [0.25, 0.5, 2.0, 4.0])
def test_a_tempo_changes_the_duration_and_keeps_the_pitch(tempo: float) -> None:
    parts, encoder = encode("pcm", tone(2.0, 16000, hz=500.0), 16000, tempo)
    samples = np.frombuffer(b"".join(parts), "<i2").astype(np.float32)
    assert len(samples) == encoder.samples
    assert encoder.duration == pytest.approx(2.0 / tempo, rel=0.05)
    spectrum = np.abs(np.fft.rfft(samples))
    peak_hz = np.argmax(spectrum) * OUTPUT_RATE / len(samples)
    assert peak_hz == pytest.approx(500.0, rel=0.03)  # resampling would have moved it


def test_atempo_chains_stay_within_one_filters_range() -> None:
    assert _atempo_chain(1.0) == []
    assert _atempo_chain(4.0) == [2.0, 2.0] and _atempo_chain(0.25) == [0.5, 0.5]
    assert _atempo_chain(3.0) == [2.0, 1.5]
    assert np.prod(_atempo_chain(0.3)) == pytest.approx(0.3)


def test_nothing_in_gives_a_valid_empty_file() -> None:
    for fmt in FORMATS:
        encoder = Encoder(fmt, 8000)
        assert encoder.add(np.zeros(0, np.float32)) == b""
        data = encoder.finish()
        assert encoder.duration == 0.0 and encoder.finish() == b""
        if fmt == "wav":
            assert data == wav_header()
        elif fmt in ("pcm", "mp3", "aac"):  # bare frames: no frame, no byte
            assert data == b""
        else:  # a container's headers, and no audio
            assert data.startswith(b"OggS" if fmt == "opus" else b"fLaC")


def test_bad_arguments_and_use_after_finish_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown audio format 'ogg'"):
        Encoder("ogg", 24000)
    with pytest.raises(ValueError, match="tempo 5"):
        Encoder("wav", 24000, 5.0)
    encoder = Encoder("mp3", 24000)
    encoder.add(tone(0.1, 24000))
    encoder.finish()
    with pytest.raises(RuntimeError):
        encoder.add(tone(0.1, 24000))
    dropped = Encoder("opus", 24000)
    dropped.add(tone(0.1, 24000))
    dropped.close()  # an aborted response: nothing more, no error
