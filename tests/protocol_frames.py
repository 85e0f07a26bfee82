"""Wire frames the protocol tests share: a plain Add and StepOutputs that every protocol
since 2 can read, and for each later protocol frames that set the fields it appended."""

from __future__ import annotations

from shared.protocol import Add, StepOutputs
from shared.types import (
    AudioPart,
    CanonicalRequest,
    ErrorCode,
    FinishReason,
    ImagePart,
    Message,
    OutputFormat,
    Reasoning,
    RequestError,
    RequestKind,
    RequestOutput,
    ResponseFormat,
    SamplingParams,
    Segment,
    TextPart,
    TokenLogprob,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolChoiceMode,
    TopLogprob,
    Usage,
    Word,
)

ADD = Add(
    "req-1",
    RequestKind.CHAT,
    CanonicalRequest(messages=[Message("system", "Be brief."), Message("user", "Hi", name="bob")]),
    SamplingParams(
        max_tokens=32,
        temperature=0.5,
        seed=7,
        stop=["\n\n"],
        stop_token_ids=[2],
        logit_bias={5: -1.5},
    ),
)
STEP = StepOutputs(
    "w1",
    17,
    [
        RequestOutput("req-1", text="h\u00e9", token_ids=[104, 233]),
        RequestOutput(
            "req-2",
            finish_reason=FinishReason.ERROR,
            usage=Usage(5, 1, 0),
            error=RequestError(ErrorCode.INTERNAL, "boom", "x"),
        ),
    ],
)

# Completions' echo + logprobs with max_tokens 0 (lm-evaluation-harness's scoring request),
# at batch priority: every field protocol 3 appended to SamplingParams set.
ADD_ECHO = Add(
    "req-3",
    RequestKind.COMPLETION,
    CanonicalRequest(prompt_token_ids=[0, 17, 42]),
    SamplingParams(max_tokens=0, temperature=0.0, logprobs=True, top_logprobs=5, echo=True),
    1,
)
# Every field protocol 3 appended to RequestOutput: an echo's prompt text and prompt
# logprobs (the first has none), a sampled token's logprob with alternatives, a stop string.
STEP_LOGPROBS = StepOutputs(
    "w1",
    18,
    [
        RequestOutput(
            "req-3",
            finish_reason=FinishReason.LENGTH,
            usage=Usage(3),
            prompt_logprobs=[
                TokenLogprob(0, "ab"),
                TokenLogprob(
                    17, " c", -1.5, [TopLogprob(9, "x", -0.5), TopLogprob(17, " c", -1.5)]
                ),
            ],
            prompt_text="ab c",
        ),
        RequestOutput(
            "req-4",
            text="d",
            token_ids=[12],
            finish_reason=FinishReason.STOP,
            usage=Usage(4, 2),
            logprobs=[
                TokenLogprob(12, "d", -0.25, [TopLogprob(12, "d", -0.25, b"d")], b"d"),
                TokenLogprob(13, "\ufffd", -0.5, [], b"\xc3"),
            ],
            stop="\n\n",
        ),
    ],
)

# Every field protocol 4 appended to Message: images as bytes and as a URL, audio, an
# assistant's tool call and reasoning, a tool's result (and protocol 7's image `where`).
ADD_RICH = Add(
    "req-5",
    RequestKind.CHAT,
    CanonicalRequest(
        messages=[
            Message(
                "user",
                "Look: ",
                parts=[
                    TextPart("Look: "),
                    ImagePart(b"\x89PNG", media_type="image/png", where="messages[0].content[1]"),
                    ImagePart(url="https://example.com/a.jpg", detail="low"),
                    AudioPart(b"RIFF", format="wav"),
                ],
            ),
            Message(
                "assistant",
                "",
                tool_calls=[ToolCall("call_1", "get_weather", '{"city": "Oslo"}')],
                reasoning="They want weather.",
            ),
            Message("tool", "12C", tool_call_id="call_1"),
        ]
    ),
    SamplingParams(),
)

# Protocol 5: tools with a forced choice, a JSON schema, a thinking budget; a delta with
# reasoning text and a tool call's first and later pieces.
ADD_TOOLS = Add(
    "req-6",
    RequestKind.CHAT,
    CanonicalRequest(
        messages=[Message("user", "Weather?")],
        tools=[Tool("get_weather", "Look it up", {"type": "object"}, strict=True)],
        tool_choice=ToolChoice(ToolChoiceMode.REQUIRED, "get_weather", parallel=False),
        response_format=ResponseFormat(OutputFormat.JSON_SCHEMA, {"type": "object"}, "w"),
        reasoning=Reasoning(True, 64),
    ),
    SamplingParams(),
)
STEP_TOOLS = StepOutputs(
    "w1",
    19,
    [
        RequestOutput("req-6", reasoning="hm", tool_calls=[ToolCallDelta(0, "call_1", "f")]),
        RequestOutput(
            "req-6",
            token_ids=[7],
            finish_reason=FinishReason.TOOL_CALLS,
            tool_calls=[ToolCallDelta(0, arguments='{"a": 1}')],
        ),
    ],
)

# Protocol 6: an embedding request of two texts; its answer, two 2-dimensional vectors.
ADD_EMBED = Add(
    "req-7",
    RequestKind.EMBEDDING,
    CanonicalRequest(inputs=["a", "b c"]),
    SamplingParams(),
)
STEP_EMBED = StepOutputs(
    "w1",
    20,
    [
        RequestOutput(
            "req-7",
            finish_reason=FinishReason.STOP,
            usage=Usage(3),
            embeddings=b"\x00\x00\x80?" * 4,
            dimensions=2,
        )
    ],
)

# Protocol 8: a transcription of a WAV file with word timestamps, a speech request, and
# their answers (segments with words; a chunk of audio).
ADD_TRANSCRIBE = Add(
    "req-8",
    RequestKind.TRANSCRIPTION,
    CanonicalRequest(
        prompt="Earlier words.",
        audio=AudioPart(b"RIFF", format="wav"),
        language="en",
        timestamps=["segment", "word"],
    ),
    SamplingParams(temperature=0.0),
)
ADD_SPEECH = Add(
    "req-9",
    RequestKind.SPEECH,
    CanonicalRequest(prompt="Hello there.", voice="alloy", speed=1.25, audio_format="mp3"),
    SamplingParams(),
)
STEP_SPEECH = StepOutputs(
    "w1",
    18,
    [
        RequestOutput(
            "req-8",
            "hello world",
            finish_reason=FinishReason.STOP,
            segments=[
                Segment(0, 0.0, 1.5, " hello world", [50364, 7751], words=[Word("hello", 0.0, 0.7)])
            ],
            language="en",
            duration=1.5,
        ),
        RequestOutput("req-9", audio=b"\xff\xfb", duration=0.5),
    ],
)
