"""Uploaded audio -> 16 kHz mono float32, with PyAV: every container a client sends decodes to
the right length, stereo is mixed down, and every file that is not usable audio is a 400
naming `file` (never a PyAV exception)."""

from __future__ import annotations

import io
import wave

import av
import numpy as np
import pytest

from shared.types import ErrorCode
from worker.preprocess import PreprocessError
from worker.speech.audio import SAMPLE_RATE, decode_audio

SECONDS = 2.0
TONE_HZ = 440.0


def sine(rate: int, seconds: float = SECONDS, channels: int = 1) -> np.ndarray:
    """(channels, samples) float32: a 440 Hz tone, 0.3 of full scale, the same in each."""
    t = np.arange(int(rate * seconds)) / rate
    tone = (0.3 * np.sin(2 * np.pi * TONE_HZ * t)).astype(np.float32)
    return np.ascontiguousarray(np.tile(tone, (channels, 1)))


def encode(
    container: str, codec: str, rate: int, channels: int = 1, seconds: float = SECONDS
) -> bytes:
    """A file made by PyAV (FFmpeg's encoders), as a client would upload it."""
    layout = "stereo" if channels == 2 else "mono"
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate)
        stream.layout = layout
        frame = av.AudioFrame.from_ndarray(
            sine(rate, seconds, channels), format="fltp", layout=layout
        )
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    return buf.getvalue()


# (extension, container, codec, sample rate, seconds of slack: a lossy codec's priming)
FORMATS = [
    ("wav", "wav", "pcm_s16le", 44100, 0.0),
    ("mp3", "mp3", "libmp3lame", 44100, 0.1),
    ("flac", "flac", "flac", 44100, 0.0),
    ("ogg", "ogg", "libopus", 48000, 0.1),
    ("m4a", "ipod", "aac", 44100, 0.15),
    ("webm", "webm", "libopus", 48000, 0.1),
    ("mp4", "mp4", "aac", 22050, 0.15),
]


@pytest.mark.parametrize(("ext", "container", "codec", "rate", "slack"), FORMATS)
def test_stereo_files_of_every_container_decode_to_16k_mono(
    ext: str, container: str, codec: str, rate: int, slack: float
) -> None:
    data = encode(container, codec, rate, channels=2)
    audio = decode_audio(data, max_seconds=60, extension=ext)
    assert audio.samples.dtype == np.float32 and audio.samples.ndim == 1
    assert SECONDS - 0.01 <= audio.duration <= SECONDS + slack
    assert audio.duration == len(audio.samples) / SAMPLE_RATE
    # still the tone: its strongest frequency is 440 Hz at 16 kHz (not resampled wrong)
    spectrum = np.abs(np.fft.rfft(audio.samples))
    peak_hz = np.argmax(spectrum) * SAMPLE_RATE / len(audio.samples)
    assert abs(peak_hz - TONE_HZ) < 5
    assert 0.2 < np.abs(audio.samples).max() < 1.0


def test_wav_decodes_exactly_and_the_extension_is_only_a_hint() -> None:
    data = encode("wav", "pcm_s16le", 16000)
    exact = decode_audio(data, 60, "wav")
    assert len(exact.samples) == 32000
    np.testing.assert_allclose(exact.samples, sine(16000)[0], atol=1e-3)
    # a wrong or missing extension: the container is found from the bytes
    for ext in ("mp3", "", "bin"):
        np.testing.assert_array_equal(decode_audio(data, 60, ext).samples, exact.samples)


def test_a_file_ffmpeg_cannot_recognize_decodes_by_its_extension() -> None:
    # junk before raw ADTS frames: the probe gives up, the extension names the demuxer
    data = b"junk" * 500 + encode("adts", "aac", 16000)
    assert "cannot decode" in _rejected(data, ext="")
    assert decode_audio(data, 60, "aac").duration == pytest.approx(SECONDS, abs=0.15)


def test_a_truncated_upload_decodes_what_it_holds() -> None:
    data = encode("mp3", "libmp3lame", 16000)
    audio = decode_audio(data[: len(data) // 2], 60, "mp3")
    assert 0.5 < audio.duration < 1.5


def test_a_file_with_nan_samples_decodes_finite() -> None:
    buf = io.BytesIO()
    with av.open(buf, "w", format="wav") as out:
        stream = out.add_stream("pcm_f32le", rate=16000)
        stream.layout = "mono"
        samples = sine(16000)
        samples[0, 100:200] = np.nan
        frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
        frame.sample_rate = 16000
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    audio = decode_audio(buf.getvalue(), 60, "wav")
    assert np.isfinite(audio.samples).all() and not audio.samples[100:200].any()


def _rejected(data: bytes, max_seconds: float = 60, ext: str = "") -> str:
    with pytest.raises(PreprocessError) as caught:
        decode_audio(data, max_seconds, ext)
    error = caught.value.error
    assert error.code == ErrorCode.INVALID_REQUEST and error.param == "file"
    return error.message


def test_garbage_empty_and_headerless_files_are_400s() -> None:
    assert "empty" in _rejected(b"")
    assert "cannot decode a .mp3 file" in _rejected(b"not audio at all " * 40, ext="mp3")
    assert "cannot decode" in _rejected(b"RIFF\x00\x00\x00\x00WAVEjunk", ext="wav")
    mp3 = encode("mp3", "libmp3lame", 16000)
    assert "cannot decode" in _rejected(mp3[:100], ext="mp3")


def test_a_file_without_samples_is_a_400() -> None:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes(b"")
    assert "no audio samples" in _rejected(buf.getvalue(), ext="wav")


def test_a_video_without_sound_is_a_400() -> None:
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        frame = av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    assert "no audio stream" in _rejected(buf.getvalue(), ext="mp4")


def test_audio_longer_than_the_limit_is_a_400_and_at_the_limit_is_not() -> None:
    data = encode("flac", "flac", 16000, seconds=3.0)
    assert "longer than 2.5 s" in _rejected(data, max_seconds=2.5)
    assert decode_audio(data, max_seconds=3.0).duration == 3.0


def _wav(rate: int, frames: int, block_align: int | None = None) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(1)
        out.setframerate(rate)
        out.writeframes(b"\x80" * frames)
    data = bytearray(buf.getvalue())
    if block_align is not None:  # the fmt chunk's, as a crafted file sets it
        data[32:34] = block_align.to_bytes(2, "little")
    return bytes(data)


def test_a_rate_too_low_for_speech_is_a_400_before_it_is_resampled() -> None:
    """A few bytes at 1 Hz would be thousands of times as many samples at 16 kHz."""
    assert "sample rate (1 Hz) is below 4000 Hz" in _rejected(_wav(1, 70_000, 16384), 3600)
    assert decode_audio(_wav(8000, 8000), max_seconds=2).duration == 1.0  # telephony's rate


def test_a_long_frame_is_refused_by_what_it_will_hold() -> None:
    assert "longer than 1 s" in _rejected(_wav(4000, 40_000), max_seconds=1)
