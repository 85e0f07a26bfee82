"""Worker outputs -> OpenAI response bodies and SSE: chat and completion formatters,
streamed and whole, with n choices, logprobs, echo and usage; stream errors; usage totals."""

from __future__ import annotations

import json
from typing import Any

from gateway.api.openai.translate import ChatFormatter, CompletionFormatter
from gateway.api.relay import DONE, Choice, total_usage
from gateway.errors import GatewayError
from shared.types import ErrorCode, FinishReason, RequestOutput, TokenLogprob, TopLogprob, Usage
from tests.openai_bodies import one, sse

TOP = [TopLogprob(7, "Hel", -0.25), TopLogprob(9, "Yo", -1.5)]
HEL = TokenLogprob(7, "Hel", -0.25, TOP)


def delta(text: str = "", tokens: list[int] | None = None, **fields: Any) -> RequestOutput:
    return RequestOutput("r", text=text, token_ids=tokens or [], **fields)


def done(reason: FinishReason = FinishReason.STOP, **fields: Any) -> RequestOutput:
    return RequestOutput("r", finish_reason=reason, **fields)


def test_chat_formatter_stream() -> None:
    fmt = ChatFormatter("chat-model", include_usage=True)
    first = delta("Hel", [7], usage=Usage(prompt_tokens=4, completion_tokens=1))
    role = one(fmt.stream_start(first))
    assert role["object"] == "chat.completion.chunk"
    assert role["id"].startswith("chatcmpl-")
    assert role["model"] == "chat-model"
    assert isinstance(role["created"], int)
    assert role["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "finish_reason": None,
            "logprobs": None,
        }
    ]
    text = one(fmt.stream_delta(0, first))
    assert text["choices"] == [
        {"index": 0, "delta": {"content": "Hel"}, "finish_reason": None, "logprobs": None}
    ]
    assert text["id"] == role["id"]
    assert fmt.stream_delta(0, delta("", [8])) == b""  # text held back: nothing to send
    finish = one(fmt.stream_finish(0, done(FinishReason.LENGTH)))
    assert finish["choices"][0]["delta"] == {}
    assert finish["choices"][0]["finish_reason"] == "length"
    *usage_events, last = sse(fmt.stream_end(Usage(4, 3, cached_tokens=2)))
    assert last == "[DONE]"
    (usage,) = usage_events
    assert usage["choices"] == []
    assert usage["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 3,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    assert ChatFormatter("m").stream_end(Usage(1, 1)) == DONE  # without include_usage


def test_chat_formatter_stream_with_n_choices() -> None:
    fmt = ChatFormatter("m", n=3)
    roles = sse(fmt.stream_start(delta("x", [1])))
    assert [e["choices"][0]["index"] for e in roles] == [0, 1, 2]
    assert all(e["choices"][0]["delta"] == {"role": "assistant", "content": ""} for e in roles)
    assert len({e["id"] for e in roles}) == 1
    assert one(fmt.stream_delta(2, delta("z", [3])))["choices"][0]["index"] == 2
    finish = one(fmt.stream_finish(1, done()))["choices"][0]
    assert (finish["index"], finish["finish_reason"]) == (1, "stop")


def test_chat_formatter_logprobs() -> None:
    fmt = ChatFormatter("m", logprobs=True)
    chunk = one(fmt.stream_delta(0, delta("Hel", [7], logprobs=[HEL])))
    assert chunk["choices"][0]["logprobs"] == {
        "content": [
            {
                "token": "Hel",
                "logprob": -0.25,
                "bytes": [72, 101, 108],
                "top_logprobs": [
                    {"token": "Hel", "logprob": -0.25, "bytes": [72, 101, 108]},
                    {"token": "Yo", "logprob": -1.5, "bytes": [89, 111]},
                ],
            }
        ],
        "refusal": None,
    }
    # a token whose text is held back (half a UTF-8 character) still reports its logprob
    held = TokenLogprob(200, "\ufffd", -3.0)
    chunk = one(fmt.stream_delta(0, delta("", [200], logprobs=[held])))
    assert chunk["choices"][0]["delta"] == {"content": ""}
    entry = chunk["choices"][0]["logprobs"]["content"][0]
    assert entry["top_logprobs"] == []
    assert entry["bytes"] == list("\ufffd".encode())
    # logprobs not asked for: none shown even if the worker sent some
    plain = one(ChatFormatter("m").stream_delta(0, delta("Hel", [7], logprobs=[HEL])))
    assert plain["choices"][0]["logprobs"] is None


def test_chat_formatter_response() -> None:
    fmt = ChatFormatter("m", n=2, logprobs=True)
    a, b = Choice(0), Choice(1)
    a.add(delta("Hel", [7], logprobs=[HEL]))
    a.add(done(FinishReason.STOP, usage=Usage(4, 1)))
    b.add(done(FinishReason.LENGTH, text="Yo", token_ids=[9], usage=Usage(4, 1)))
    full = json.loads(fmt.response([a, b], Usage(4, 2, cached_tokens=3)))
    assert full["object"] == "chat.completion"
    assert full["id"].startswith("chatcmpl-")
    assert [c["index"] for c in full["choices"]] == [0, 1]
    assert full["choices"][0]["message"] == {"content": "Hel", "role": "assistant"}
    assert full["choices"][0]["finish_reason"] == "stop"
    assert full["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.25
    assert full["choices"][1]["message"]["content"] == "Yo"
    assert full["choices"][1]["finish_reason"] == "length"
    assert full["choices"][1]["logprobs"] == {"content": [], "refusal": None}
    assert full["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 2,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    plain = json.loads(ChatFormatter("m").response([a], Usage(4, 1)))
    assert plain["choices"][0]["logprobs"] is None


def test_formatters_stream_error() -> None:
    error = GatewayError(ErrorCode.CANCELLED, "request r was cancelled")
    for fmt in (ChatFormatter("m"), CompletionFormatter("m", [None])):
        body, last = sse(fmt.stream_error(error))
        assert last == "[DONE]"
        assert body["error"]["code"] == "cancelled"
        assert body["error"]["message"] == "request r was cancelled"


def test_completion_formatter_stream() -> None:
    fmt = CompletionFormatter("base-model", ["Once", "Once"], include_usage=True)
    first = delta("abc", [1])
    assert fmt.stream_start(first) == b""  # no role chunk in completions
    text = one(fmt.stream_delta(1, first))
    assert text["object"] == "text_completion"
    assert text["id"].startswith("cmpl-")
    assert text["model"] == "base-model"
    assert text["choices"] == [{"index": 1, "text": "abc", "finish_reason": None, "logprobs": None}]
    assert fmt.stream_delta(0, delta("", [2])) == b""
    finish = one(fmt.stream_finish(0, done()))
    assert finish["choices"][0] == {
        "index": 0,
        "text": "",
        "finish_reason": "stop",
        "logprobs": None,
    }
    usage, last = sse(fmt.stream_end(Usage()))
    assert last == "[DONE]"
    assert usage["choices"] == []
    assert usage["usage"] == {
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "total_tokens": 0,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    cached = sse(fmt.stream_end(Usage(6, 2, cached_tokens=5)))[0]
    assert cached["usage"]["prompt_tokens_details"] == {"cached_tokens": 5}
    assert CompletionFormatter("m", [None]).stream_end(Usage(1, 1)) == DONE


def test_completion_formatter_response() -> None:
    fmt = CompletionFormatter("base-model", ["a", "b"])
    x, y = Choice(0), Choice(1)
    x.add(done(FinishReason.LENGTH, text="xyz", token_ids=[5, 6, 7], usage=Usage(2, 3)))
    y.add(done(FinishReason.STOP, text="", usage=Usage(2, 1)))
    full = json.loads(fmt.response([x, y], Usage(4, 4, cached_tokens=1)))
    assert full["object"] == "text_completion"
    assert full["choices"] == [
        {"index": 0, "text": "xyz", "finish_reason": "length", "logprobs": None},
        {"index": 1, "text": "", "finish_reason": "stop", "logprobs": None},
    ]
    assert full["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 4,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 1},
    }


PROMPT_LOGPROBS = [
    TokenLogprob(1, "Once"),
    TokenLogprob(2, " up", -2.0, [TopLogprob(3, " a", -1.0)]),
]


def test_completion_echo_with_logprobs_stream() -> None:
    """lm-evaluation-harness's shape: the prompt's tokens first, the first logprob null,
    text_offset running through prompt and completion."""
    fmt = CompletionFormatter("m", ["Once up"], echo=True, logprobs=1)
    on = TokenLogprob(4, "on", -0.5, [TopLogprob(4, "on", -0.5)])
    first = delta("on", [4], logprobs=[on], prompt_text="Once up", prompt_logprobs=PROMPT_LOGPROBS)
    choice = one(fmt.stream_delta(0, first))["choices"][0]
    assert choice["text"] == "Once upon"
    assert choice["logprobs"] == {
        "tokens": ["Once", " up", "on"],
        "token_logprobs": [None, -2.0, -0.5],
        "top_logprobs": [None, {" a": -1.0}, {"on": -0.5}],
        "text_offset": [0, 4, 7],
    }
    # later deltas: no prompt again, offsets continue
    more = one(fmt.stream_delta(0, delta(" a", [3], logprobs=[TokenLogprob(3, " a", -0.1)])))
    assert more["choices"][0]["text"] == " a"
    assert more["choices"][0]["logprobs"]["text_offset"] == [9]
    assert more["choices"][0]["logprobs"]["top_logprobs"] == [{}]


def test_completion_echo_scoring_only_response() -> None:
    """max_tokens 0: the prompt alone; token ids as the prompt: its decoded text."""
    fmt = CompletionFormatter("m", [None, "given"], echo=True, logprobs=0)
    scored = Choice(0)
    scored.add(
        done(
            FinishReason.LENGTH,
            usage=Usage(prompt_tokens=2),
            prompt_text="Once up",
            prompt_logprobs=PROMPT_LOGPROBS,
        )
    )
    plain = Choice(1)
    plain.add(done(FinishReason.LENGTH, prompt_text="decoded", usage=Usage(prompt_tokens=1)))
    full = json.loads(fmt.response([scored, plain], Usage(prompt_tokens=3)))
    first, second = full["choices"]
    assert first["text"] == "Once up"  # decoded from the ids
    assert first["finish_reason"] == "length"
    assert first["logprobs"]["tokens"] == ["Once", " up"]
    assert first["logprobs"]["token_logprobs"] == [None, -2.0]
    assert first["logprobs"]["text_offset"] == [0, 4]
    assert second["text"] == "given"  # the prompt as sent wins over its decoding
    assert full["usage"]["prompt_tokens"] == 3 and full["usage"]["total_tokens"] == 3


def test_completion_echo_without_logprobs() -> None:
    fmt = CompletionFormatter("m", ["Hi"], echo=True)
    first = delta(" there", [5], prompt_text="Hi", prompt_logprobs=[])
    choice = one(fmt.stream_delta(0, first))["choices"][0]
    assert choice == {"index": 0, "text": "Hi there", "finish_reason": None, "logprobs": None}
    # no echo asked: the prompt is not repeated even if the worker sent it
    fmt = CompletionFormatter("m", ["Hi"])
    assert one(fmt.stream_delta(0, first))["choices"][0]["text"] == " there"


def test_usage_parses_in_the_openai_sdk() -> None:
    from openai.types import CompletionUsage

    body = ChatFormatter("m").response([Choice(0)], Usage(10, 2, cached_tokens=8))
    usage = CompletionUsage.model_validate(json.loads(body)["usage"])
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 8


def test_total_usage_counts_a_prompt_and_its_cached_tokens_once() -> None:
    """n choices of one prompt share its count and its cache hit; completions add up."""
    usages: list[Usage | None] = [Usage(10, 3, 8), Usage(10, 4, 10), Usage(6, 1, 0), None]
    assert total_usage(usages, [0, 0, 1, 1]) == Usage(16, 8, 8)
