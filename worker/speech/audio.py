"""An uploaded audio file -> mono float32 samples at 16 kHz (what Whisper hears), with PyAV.

Any container and codec FFmpeg reads goes: wav, mp3, m4a/aac, ogg/opus/vorbis, flac, webm,
mp4 (its first audio stream; video is skipped). The container is found from the bytes; the
client's file extension is only a hint for formats FFmpeg cannot recognize by their content
(raw ADTS AAC, say). Every failure is a 400 naming the request's `file`: PyAV's exceptions
never leave this module.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import av
import numpy as np

from shared.types import ErrorCode, RequestError
from worker.preprocess import PreprocessError

SAMPLE_RATE = 16000
# FFmpeg's demuxer for a file extension, for files it cannot recognize by their content
DEMUXERS = {
    "aac": "aac",
    "flac": "flac",
    "m4a": "mov",
    "mp3": "mp3",
    "mp4": "mov",
    "mpeg": "mp3",
    "mpga": "mp3",
    "oga": "ogg",
    "ogg": "ogg",
    "opus": "ogg",
    "wav": "wav",
    "webm": "matroska",
}


@dataclass(frozen=True, slots=True)
class DecodedAudio:
    samples: np.ndarray  # float32, mono, SAMPLE_RATE a second
    duration: float  # seconds

    @staticmethod
    def of(samples: np.ndarray) -> DecodedAudio:
        return DecodedAudio(samples, len(samples) / SAMPLE_RATE)


def decode_audio(data: bytes, max_seconds: float, extension: str = "") -> DecodedAudio:
    """The file's first audio stream, mixed down to mono and resampled to 16 kHz.

    A 400 (PreprocessError, param "file") when the bytes are empty, are no audio FFmpeg
    decodes, hold no samples or last longer than `max_seconds` (decoding stops there)."""
    if not data:
        raise _invalid("the audio file is empty")
    what = f"a .{extension} file" if extension else "the file"
    try:
        samples = _decode(data, max_seconds, extension.lower().lstrip("."))
    except PreprocessError:
        raise
    except Exception as exc:  # FFmpeg on a client's bytes: any failure is the file's
        raise _invalid(f"cannot decode {what} as audio ({_reason(exc)})") from None
    if not len(samples):
        raise _invalid(f"{what} holds no audio samples")
    return DecodedAudio.of(samples)


# Telephony's 8 kHz is the lowest rate speech comes at; below, a file is a way to make a
# worker resample a few bytes into gigabytes
MIN_SAMPLE_RATE = 4000


def _decode(data: bytes, max_seconds: float, extension: str) -> np.ndarray:
    """Packet by packet, as FFmpeg's command line does: a packet its codec rejects (a
    corrupt one, the cut-off last one of a truncated upload) is skipped; a file none of
    whose packets decode is a 400."""
    limit = int(max_seconds * SAMPLE_RATE)
    chunks: list[np.ndarray] = []
    with _open(data, extension) as container:
        if not container.streams.audio:
            raise _invalid("the file has no audio stream")
        stream = container.streams.audio[0]
        resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
        total, error = 0, None
        for packet in container.demux(stream):  # its last, empty packet flushes the decoder
            try:
                frames = packet.decode()
            except av.FFmpegError as exc:
                error = error or exc
                continue
            for frame in frames:
                rate = frame.sample_rate or SAMPLE_RATE
                if rate < MIN_SAMPLE_RATE:  # one sample would become thousands here
                    raise _invalid(
                        f"the audio's sample rate ({rate} Hz) is below {MIN_SAMPLE_RATE} Hz"
                    )
                # what it will hold once resampled, before it is: a long frame of a low
                # rate must not grow past the limit in memory first
                if total + frame.samples * SAMPLE_RATE / rate > limit + SAMPLE_RATE:
                    raise _too_long(max_seconds)
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1))
                    total += len(chunks[-1])
            if total > limit:
                raise _too_long(max_seconds)
        chunks += [out.to_ndarray().reshape(-1) for out in resampler.resample(None)]
    if not chunks and error is not None:
        raise error
    samples = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    if len(samples) > limit:
        raise _too_long(max_seconds)
    # float codecs can carry NaN or infinities: silence and full scale, not NaN logits
    return np.nan_to_num(samples.astype(np.float32, copy=False), nan=0.0, posinf=1.0, neginf=-1.0)


def _open(data: bytes, extension: str) -> av.container.InputContainer:
    """The container probed from the bytes, else the one the extension names."""
    try:
        return av.open(io.BytesIO(data), mode="r")
    except av.FFmpegError:
        demuxer = DEMUXERS.get(extension)
        if demuxer is None:
            raise
        return av.open(io.BytesIO(data), mode="r", format=demuxer)


def _reason(exc: Exception) -> str:
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return text.split(":")[0].strip() if isinstance(exc, av.FFmpegError) else text


def _too_long(max_seconds: float) -> PreprocessError:
    return _invalid(f"the audio is longer than {max_seconds:g} s, the most this server takes")


def _invalid(message: str) -> PreprocessError:
    return PreprocessError(RequestError(ErrorCode.INVALID_REQUEST, message, "file"))
