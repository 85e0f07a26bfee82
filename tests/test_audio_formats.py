"""gateway/api/audio/formats.py and the form's translator: a transcript in each of OpenAI's
response formats (srt and vtt to the character), and a transcription form's fields into a
canonical request, or a 400 naming the field."""

from __future__ import annotations

import json

import pytest

from gateway.api.audio.formats import Transcript, render, srt, timestamp, vtt
from gateway.api.audio.languages import language_code, language_name
from gateway.api.audio.transcriptions import FormItem, transcript_form
from gateway.errors import GatewayError
from shared.types import AudioPart, RequestKind, Segment, Word

SEGMENTS = [
    Segment(
        0,
        0.0,
        2.5,
        " Hello there.",
        tokens=[50364, 2425],
        avg_logprob=-0.25,
        compression_ratio=1.1,
        no_speech_prob=0.01,
        words=[Word("Hello", 0.0, 0.8), Word("there.", 0.9, 2.5)],
    ),
    Segment(1, 3661.0004, 3662.9996, " General Kenobi.", words=[Word("General", 3661.0, 3662.0)]),
]
TRANSCRIPT = Transcript(" Hello there. General Kenobi.", SEGMENTS, "en", 3663.2)

SRT = (
    "1\n00:00:00,000 --> 00:00:02,500\nHello there.\n\n"
    "2\n01:01:01,000 --> 01:01:03,000\nGeneral Kenobi.\n\n"
)
VTT = (
    "WEBVTT\n\n"
    "00:00:00.000 --> 00:00:02.500\nHello there.\n\n"
    "01:01:01.000 --> 01:01:03.000\nGeneral Kenobi.\n\n"
)


@pytest.mark.parametrize(
    ("seconds", "srt_form", "vtt_form"),
    [
        (0.0, "00:00:00,000", "00:00:00.000"),
        (1.2345, "00:00:01,234", "00:00:01.234"),  # to the nearest millisecond
        (59.9996, "00:01:00,000", "00:01:00.000"),
        (3600 * 100 + 0.5, "100:00:00,500", "100:00:00.500"),
        (-0.01, "00:00:00,000", "00:00:00.000"),
    ],
)
def test_timestamps(seconds: float, srt_form: str, vtt_form: str) -> None:
    assert timestamp(seconds, ",") == srt_form
    assert timestamp(seconds, ".") == vtt_form


def test_srt_and_vtt_to_the_character() -> None:
    assert srt(SEGMENTS) == SRT
    assert vtt(SEGMENTS) == VTT
    assert render(TRANSCRIPT, "srt", "transcribe") == SRT.encode()
    assert render(TRANSCRIPT, "vtt", "translate") == VTT.encode()
    assert (srt([]), vtt([])) == ("", "WEBVTT\n\n")


def test_json_and_text() -> None:
    body = json.loads(render(TRANSCRIPT, "json", "transcribe"))
    assert body == {
        "text": " Hello there. General Kenobi.",
        "usage": {"seconds": 3664, "type": "duration"},  # whole seconds, rounded up
    }
    assert json.loads(render(TRANSCRIPT, "json", "translate")) == {"text": TRANSCRIPT.text}
    assert render(TRANSCRIPT, "text", "transcribe") == b" Hello there. General Kenobi.\n"


def test_verbose_json_segments_words_and_usage() -> None:
    body = json.loads(render(TRANSCRIPT, "verbose_json", "transcribe"))
    assert (body["task"], body["language"], body["duration"]) == ("transcribe", "english", 3663.2)
    assert body["text"] == TRANSCRIPT.text and "words" not in body
    assert body["usage"] == {"seconds": 3664, "type": "duration"}
    assert body["segments"][0] == {
        "id": 0,
        "seek": 0,
        "start": 0.0,
        "end": 2.5,
        "text": " Hello there.",
        "tokens": [50364, 2425],
        "temperature": 0.0,
        "avg_logprob": -0.25,
        "compression_ratio": 1.1,
        "no_speech_prob": 0.01,
    }
    assert body["segments"][1]["seek"] == 366100
    both = json.loads(render(TRANSCRIPT, "verbose_json", "transcribe", ["segment", "word"]))
    assert [w["word"] for w in both["words"]] == ["Hello", "there.", "General"]
    assert both["words"][1] == {"word": "there.", "start": 0.9, "end": 2.5}
    assert len(both["segments"]) == 2
    words = json.loads(render(TRANSCRIPT, "verbose_json", "transcribe", ["word"]))
    assert "segments" not in words and len(words["words"]) == 3  # only words, as OpenAI
    translated = json.loads(render(TRANSCRIPT, "verbose_json", "translate"))
    assert translated["task"] == "translate" and "usage" not in translated


def test_duration_falls_back_to_the_last_segments_end() -> None:
    body = json.loads(render(Transcript("x", SEGMENTS, "de"), "verbose_json", "transcribe"))
    assert (body["duration"], body["language"]) == (3662.9996, "german")
    assert json.loads(render(Transcript(""), "json", "transcribe"))["usage"]["seconds"] == 0


def test_language_names_and_codes() -> None:
    assert [language_name(x) for x in ("en", "EN", "English", "yue", "xx", None)] == [
        "english",
        "english",
        "english",
        "cantonese",
        "xx",
        "",
    ]
    assert [language_code(x) for x in ("fr", "French", "haitian creole", "klingon")] == [
        "fr",
        "fr",
        "ht",
        None,
    ]


WAV = AudioPart(b"RIFF....", format="wav")


def form(kind: RequestKind = RequestKind.TRANSCRIPTION, **fields: str) -> list[FormItem]:
    items: list[FormItem] = [("file", WAV), ("model", "whisper")]
    return items + list(fields.items())


def test_a_form_into_a_canonical_request() -> None:
    items = form(language="English", prompt="Kenobi", temperature="0.2")
    items += [("response_format", "verbose_json"), ("timestamp_granularities[]", "word")]
    parsed = transcript_form(RequestKind.TRANSCRIPTION, items)
    request = parsed.request()
    assert (request.audio, request.language, request.prompt) == (WAV, "en", "Kenobi")
    assert request.timestamps == ["segment", "word"]
    assert parsed.sampling().temperature == 0.2
    assert parsed.media_type is None  # JSON
    plain = transcript_form(RequestKind.TRANSLATION, form())
    assert plain.request().timestamps == [] and plain.sampling().temperature == 0.0
    assert plain.task == "translate" and plain.response_format == "json"
    srt_form = transcript_form(RequestKind.TRANSCRIPTION, form(response_format="srt"))
    assert srt_form.request().timestamps == ["segment"]
    assert srt_form.media_type == "text/plain"


@pytest.mark.parametrize(
    ("items", "param"),
    [
        ([("model", "whisper")], "file"),
        ([("file", "not a file"), ("model", "whisper")], "file"),
        ([("file", AudioPart(b"", format="wav")), ("model", "whisper")], "file"),
        ([("file", WAV)], "model"),
        ([("file", WAV), ("model", "")], "model"),
        (form(model="again"), "model"),
        ([("file", WAV), ("file", WAV), ("model", "whisper")], "file"),
        ([*form(), ("prompt", WAV)], "prompt"),
        (form(prompt="word " * 2000), "prompt"),  # a text field is bounded, not the file
        (form(response_format="diarized_json"), "response_format"),
        (form(temperature="hot"), "temperature"),
        (form(temperature="1.5"), "temperature"),
        (form(language="english please"), "language"),
        (form(stream="maybe"), "stream"),
        (form(stream="true", response_format="vtt"), "stream"),
        ([*form(), ("timestamp_granularities[]", "word")], "timestamp_granularities[]"),
        (
            [*form(response_format="verbose_json"), ("timestamp_granularities[]", "char")],
            "timestamp_granularities[]",
        ),
        ([*form(), ("include[]", "logprobs")], "include[]"),
        (form(chunking_strategy="auto"), "chunking_strategy"),
    ],
)
def test_a_bad_form_is_a_400_naming_the_field(items: list[FormItem], param: str) -> None:
    with pytest.raises(GatewayError) as info:
        transcript_form(RequestKind.TRANSCRIPTION, items)
    assert (info.value.status, info.value.param) == (400, param)


@pytest.mark.parametrize("name", ["language", "timestamp_granularities[]", "stream", "include[]"])
def test_translations_take_no_transcription_only_fields(name: str) -> None:
    with pytest.raises(GatewayError) as info:
        transcript_form(RequestKind.TRANSLATION, [*form(), (name, "en")])
    assert info.value.param == name


def test_an_unknown_language_code_passes_to_the_model() -> None:
    parsed = transcript_form(RequestKind.TRANSCRIPTION, form(language="Tok"))
    assert parsed.language == "tok"
