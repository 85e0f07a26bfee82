"""CallStream: a JSON tool-call body read char by char; the name once its string closes, the
arguments' raw text as it arrives, the same pieces joined whatever the chunking."""

from __future__ import annotations

import json

import pytest

from worker.parsing.call_stream import CallStream

CHUNKS = (1, 2, 3, 7, 1000)


def chunked(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def scan(body: str, size: int) -> tuple[CallStream, str, int | None]:
    """Feed `body` in chunks of `size`, taking after each: the stream, the arguments
    taken joined, and the number of chunks fed when the name was first known."""
    stream = CallStream()
    taken, named_at = "", None
    for n, chunk in enumerate(chunked(body, size), 1):
        stream.feed(chunk)
        if stream.name is not None and named_at is None:
            named_at = n
        taken += stream.take()
    return stream, taken, named_at


# (body as a model writes it, name, the arguments' text exactly as written)
BODIES = [
    pytest.param(
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
        "get_weather",
        '{"city": "Paris", "days": 3}',
        id="plain",
    ),
    pytest.param(
        '{"name":"search","arguments":{"q":"say \\"hi\\" {not} [json]","n":1}}',
        "search",
        '{"q":"say \\"hi\\" {not} [json]","n":1}',
        id="escaped-quotes-and-braces",
    ),
    pytest.param(
        '{"name": "f", "arguments": {"a": [1, [2, {"b": "}"}]], "c": {"d": {"e": null}}}}',
        "f",
        '{"a": [1, [2, {"b": "}"}]], "c": {"d": {"e": null}}}',
        id="nested",
    ),
    pytest.param(
        '{"name": "f", "arguments": {"path": "C:\\\\dir\\\\", "u": "\\u00e9\\n"}}',
        "f",
        '{"path": "C:\\\\dir\\\\", "u": "\\u00e9\\n"}',
        id="escaped-backslash-before-quote",
    ),
    pytest.param(
        '{"name": "count", "arguments": 42}', "count", "42", id="scalar-number-then-brace"
    ),
    pytest.param(
        '{"name": "toggle", "arguments": true , "id": 1}',
        "toggle",
        "true",
        id="scalar-literal-then-space",
    ),
    pytest.param(
        '{"name": "neg", "arguments": -1.5e3,"x": 0}', "neg", "-1.5e3", id="scalar-then-comma"
    ),
    pytest.param(
        '{"name": "echo", "arguments": "a \\"quoted\\" }{ string"}',
        "echo",
        '"a \\"quoted\\" }{ string"',
        id="string-arguments",
    ),
    pytest.param('{"name": "f", "parameters": {"k": "v"}}', "f", '{"k": "v"}', id="parameters-key"),
    pytest.param('{"name": "f", "arguments": [1, "]", [2]]}', "f", '[1, "]", [2]]', id="array"),
    pytest.param('{"name": "noop", "arguments": {}}', "noop", "{}", id="empty-object"),
    pytest.param(
        '\n  {\n  "name" :\t"f" ,\n  "arguments" :\n  {\n    "a" : 1\n  }\n}\n',
        "f",
        '{\n    "a" : 1\n  }',
        id="whitespace-and-newlines",
    ),
    pytest.param(
        '{"name": "get_\\u0077eather", "arguments": {}}', "get_weather", "{}", id="escaped-name"
    ),
    pytest.param(
        '{"type": "function", "meta": {"name": "no", "arguments": {"x": 1}}, '
        '"name": "yes", "arguments": {"y": 2}}',
        "yes",
        '{"y": 2}',
        id="nested-keys-are-not-top-level",
    ),
    pytest.param(
        '{"id": "name", "note": "arguments", "name": "f", "arguments": {"z": 0}}',
        "f",
        '{"z": 0}',
        id="key-names-as-values",
    ),
]


@pytest.mark.parametrize("size", CHUNKS)
@pytest.mark.parametrize(("body", "name", "arguments"), BODIES)
def test_name_and_raw_arguments_in_every_chunking(
    body: str, name: str, arguments: str, size: int
) -> None:
    stream, taken, _ = scan(body, size)
    assert stream.name == name
    assert stream.complete
    assert stream.arguments == arguments
    # an object or array streams as written; a string or scalar is held back (the call's
    # end sends what the parser made of it)
    assert taken == (arguments if arguments.startswith(("{", "[")) else "")
    assert stream.take() == ""
    if arguments.startswith(("{", "[")):  # what the model wrote is JSON
        assert json.loads(taken) == json.loads(body)[_key(body)]


def _key(body: str) -> str:
    return "parameters" if '"parameters"' in body else "arguments"


@pytest.mark.parametrize("size", CHUNKS)
def test_arguments_before_name_are_held_until_the_name(size: int) -> None:
    body = '{"arguments": {"q": "x", "n": [1, 2]}, "name": "search"}'
    stream = CallStream()
    taken = ""
    for chunk in chunked(body, size):
        stream.feed(chunk)
        piece = stream.take()
        if stream.name is None:
            assert piece == ""  # nothing is handed out without a name
        taken += piece
    assert stream.name == "search"
    assert taken == '{"q": "x", "n": [1, 2]}'
    assert stream.complete


def test_name_is_known_once_its_string_closes() -> None:
    stream = CallStream()
    stream.feed('{"name": "get_wea')
    assert stream.name is None
    stream.feed("ther")
    assert stream.name is None
    stream.feed('"')
    assert stream.name == "get_weather"
    assert not stream.complete


def test_arguments_stream_as_they_are_generated() -> None:
    stream = CallStream()
    stream.feed('{"name": "f", "arguments": {"city": "Pa')
    assert stream.take() == '{"city": "Pa'
    assert stream.take() == ""
    assert not stream.complete
    stream.feed('ris", "tags": ["a", "}"')
    assert stream.take() == 'ris", "tags": ["a", "}"'
    assert not stream.complete  # the brace inside a string closes nothing
    stream.feed("]}")
    assert stream.take() == "]}"
    assert stream.complete
    stream.feed("}")  # the body's own closing brace is not an argument
    assert stream.take() == ""
    assert stream.arguments == '{"city": "Paris", "tags": ["a", "}"]}'


def test_text_after_the_arguments_is_not_an_argument() -> None:
    stream = CallStream()
    stream.feed('{"name": "f", "arguments": {"a": 1}, "extra": {"b": 2}}')
    assert stream.arguments == '{"a": 1}'
    assert stream.complete


@pytest.mark.parametrize(
    "body",
    [
        pytest.param('{"name": "f", "arguments": {"a": "b"', id="cut-in-arguments"),
        pytest.param('{"name": "f", "argu', id="cut-in-key"),
        pytest.param('{"name": "f"}', id="no-arguments"),
        pytest.param('{"arguments": {"a": 1}}', id="no-name"),
        pytest.param('{"name": "f', id="cut-in-name"),
        pytest.param('{"name": null, "arguments": {}}', id="name-not-a-string"),
    ],
)
def test_incomplete_bodies_are_not_complete(body: str) -> None:
    stream = CallStream()
    stream.feed(body)
    assert not stream.complete


def test_no_name_hands_out_nothing() -> None:
    stream = CallStream()
    stream.feed('{"arguments": {"a": 1}}')
    assert stream.name is None
    assert stream.arguments == '{"a": 1}'
    assert stream.take() == ""


def test_cut_short_hands_out_what_was_written() -> None:
    stream, taken, named_at = scan('{"name": "f", "arguments": {"text": "half a sen', 3)
    assert stream.name == "f"
    assert named_at is not None
    assert taken == '{"text": "half a sen'
    assert not stream.complete


def test_not_json_reads_no_name() -> None:
    stream = CallStream()
    stream.feed('<function=f>\n<parameter=a>\n"quoted"\n</parameter>\n</function>')
    assert stream.name is None
    assert not stream.complete
    assert stream.take() == ""
