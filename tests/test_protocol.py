"""Wire frames: pinned bytes, round trips, direction checks and append-only evolution."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from shared.protocol import (
    PROTOCOL_VERSION,
    Abort,
    Add,
    Capacity,
    Codec,
    Control,
    ControlReply,
    Heartbeat,
    Hello,
    PrefixCacheStats,
    Ready,
    Refuse,
    Rejoin,
    Shutdown,
    ShutdownMode,
    StepOutputs,
    WorkerDead,
    WorkerState,
)
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

# Protocol 2's bytes for ADD and STEP, before SamplingParams gained (logprobs, top_logprobs,
# echo) and RequestOutput (logprobs, prompt_logprobs, prompt_text, stop).
V2_ADD = (
    "96a3616464a57265712d31a463686174959293a673797374656da942652062726965662ec093a4757365"
    "72a24869a3626f62c0c0c3809f20cb3fe0000000000000cb3ff000000000000000cb0000000000000000"
    "0791a20a0a9102c200cb3ff0000000000000cb0000000000000000cb00000000000000008105cbbff800"
    "0000000000c200"
)
V2_STEP = (
    "94a473746570a27731119296a57265712d31a368c3a99268cce9c0c0c096a57265712d32a090a5657272"
    "6f729305010093a8696e7465726e616ca4626f6f6da178"
)

# Protocol 3's bytes for ADD, before Message gained (parts, tool_calls, tool_call_id,
# reasoning).
V3_ADD = (
    "96a3616464a57265712d31a463686174959293a673797374656da942652062726965662ec093a4757365"
    "72a24869a3626f62c0c0c380dc001220cb3fe0000000000000cb3ff000000000000000cb000000000000"
    "00000791a20a0a9102c200cb3ff0000000000000cb0000000000000000cb00000000000000008105cbbf"
    "f8000000000000c2c200c200"
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

# Protocol 4's bytes for ADD and STEP, before CanonicalRequest gained (tools, tool_choice,
# response_format, reasoning) and RequestOutput (reasoning, tool_calls).
V4_ADD = (
    "96a3616464a57265712d31a463686174959297a673797374656da942652062726965662ec09090c0c097"
    "a475736572a24869a3626f629090c0c0c0c0c380dc001220cb3fe0000000000000cb3ff0000000000000"
    "00cb00000000000000000791a20a0a9102c200cb3ff0000000000000cb0000000000000000cb00000000"
    "000000008105cbbff8000000000000c2c200c200"
)
V4_STEP = (
    "94a473746570a2773111929ba57265712d31a368c3a99268cce9c0c0c09090c0c0c09ba57265712d32a0"
    "90a56572726f729305010093a8696e7465726e616ca4626f6f6da1789090c0c0c0"
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

# Protocol 5's bytes for ADD and STEP, before CanonicalRequest gained (inputs,
# input_token_ids, query, documents, dimensions) and RequestOutput (embeddings, dimensions,
# scores).
V5_ADD = (
    "96a3616464a57265712d31a463686174999297a673797374656da942652062726965662ec09090c0c097"
    "a475736572a24869a3626f629090c0c0c0c0c38090c0c0c0dc001220cb3fe0000000000000cb3ff00000"
    "0000000000cb00000000000000000791a20a0a9102c200cb3ff0000000000000cb0000000000000000cb"
    "00000000000000008105cbbff8000000000000c2c200c200"
)
V5_STEP = (
    "94a473746570a2773111929da57265712d31a368c3a99268cce9c0c0c09090c0c0c0a0909da57265712d"
    "32a090a56572726f72940501000093a8696e7465726e616ca4626f6f6da1789090c0c0c0a090"
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

# Protocol 7's bytes for ADD and STEP, before CanonicalRequest gained (audio, language,
# timestamps, voice, speed, audio_format) and RequestOutput (segments, language, audio,
# duration).
V7_ADD = (
    "96a3616464a57265712d31a4636861749e9297a673797374656da942652062726965662ec09090c0c097"
    "a475736572a24869a3626f629090c0c0c0c0c38090c0c0c09090c090c0dc001220cb3fe0000000000000"
    "cb3ff000000000000000cb00000000000000000791a20a0a9102c200cb3ff0000000000000cb00000000"
    "00000000cb00000000000000008105cbbff8000000000000c2c200c200"
)
V7_STEP = (
    "94a473746570a277311192dc0010a57265712d31a368c3a99268cce9c0c0c09090c0c0c0a090c4000090"
    "dc0010a57265712d32a090a56572726f72940501000093a8696e7465726e616ca4626f6f6da1789090c0"
    "c0c0a090c4000090"
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

# Protocol 8's bytes for ADD, before CanonicalRequest gained `resumed`.
V8_ADD = (
    "96a3616464a57265712d31a463686174dc00149297a673797374656da942652062726965662ec09090c0"
    "c097a475736572a24869a3626f629090c0c0c0c0c38090c0c0c09090c090c0c0c090c0c0c0dc001220cb"
    "3fe0000000000000cb3ff000000000000000cb00000000000000000791a20a0a9102c200cb3ff0000000"
    "000000cb0000000000000000cb00000000000000008105cbbff8000000000000c2c200c200"
)

TO_WORKER = {
    "add": (
        ADD,
        # as V3_ADD, each Message a 7-array (97, was 93) ending 90 90 c0 c0; the request an
        # 14-array (9e; 99 in v5, 95 before) ending 90 c0 c0 c0 90 90 c0 90 c0
        "97a3616464a57265712d31a463686174dc00159297a673797374656da942652062726965662ec09090c0"
        "c097a475736572a24869a3626f629090c0c0c0c0c38090c0c0c09090c090c0c0c090c0c0c090dc001220"
        "cb3fe0000000000000cb3ff000000000000000cb00000000000000000791a20a0a9102c200cb3ff00000"
        "00000000cb0000000000000000cb00000000000000008105cbbff8000000000000c2c200c20000",
    ),
    "add_rich_messages": (
        ADD_RICH,
        "97a3616464a57265712d35a463686174dc00159397a475736572a64c6f6f6b3a20c09492a474657874a6"
        "4c6f6f6b3a2096a5696d616765c40489504e47a9696d6167652f706e67c0c0b66d657373616765735b30"
        "5d2e636f6e74656e745b315d96a5696d616765c400c0b968747470733a2f2f6578616d706c652e636f6d"
        "2f612e6a7067a36c6f77c094a5617564696fc40452494646a3776176c090c0c097a9617373697374616e"
        "74a0c0909193a663616c6c5f31ab6765745f77656174686572b07b2263697479223a20224f736c6f227d"
        "c0b2546865792077616e7420776561746865722e97a4746f6f6ca3313243c09090a663616c6c5f31c0c0"
        "c0c38090c0c0c09090c090c0c0c090c0c0c090dc0012c0cb3ff0000000000000cb3ff000000000000000"
        "cb0000000000000000c09090c200cb3ff0000000000000cb0000000000000000cb000000000000000080"
        "c2c200c20000",
    ),
    "add_echo_logprobs": (
        ADD_ECHO,
        "97a3616464a57265712d33aa636f6d706c6574696f6edc001590c09300112ac38090c0c0c09090c090c0"
        "c0c090c0c0c090dc001200cb0000000000000000cb3ff000000000000000cb0000000000000000c09090"
        "c200cb3ff0000000000000cb0000000000000000cb000000000000000080c2c305c30100",
    ),
    "add_tools": (
        ADD_TOOLS,
        "97a3616464a57265712d36a463686174dc00159197a475736572a8576561746865723fc09090c0c0c0c0"
        "c3809194ab6765745f77656174686572aa4c6f6f6b20697420757081a474797065a66f626a656374c393"
        "a87265717569726564ab6765745f77656174686572c295ab6a736f6e5f736368656d6181a474797065a6"
        "6f626a656374a177c2af726573706f6e73655f666f726d617493c340c09090c090c0c0c090c0c0c090dc"
        "0012c0cb3ff0000000000000cb3ff000000000000000cb0000000000000000c09090c200cb3ff0000000"
        "000000cb0000000000000000cb000000000000000080c2c200c20000",
    ),
    "add_embed": (
        ADD_EMBED,
        "97a3616464a57265712d37a9656d62656464696e67dc001590c0c0c38090c0c0c092a161a362206390c0"
        "90c0c0c090c0c0c090dc0012c0cb3ff0000000000000cb3ff000000000000000cb0000000000000000c0"
        "9090c200cb3ff0000000000000cb0000000000000000cb000000000000000080c2c200c20000",
    ),
    "add_transcribe": (
        ADD_TRANSCRIBE,
        "97a3616464a57265712d38ad7472616e736372697074696f6edc001590ae4561726c69657220776f7264"
        "732ec0c38090c0c0c09090c090c094a5617564696fc40452494646a3776176c0a2656e92a77365676d65"
        "6e74a4776f7264c0c0c090dc0012c0cb0000000000000000cb3ff000000000000000cb00000000000000"
        "00c09090c200cb3ff0000000000000cb0000000000000000cb000000000000000080c2c200c20000",
    ),
    "add_speech": (
        ADD_SPEECH,
        "97a3616464a57265712d39a6737065656368dc001590ac48656c6c6f2074686572652ec0c38090c0c0c0"
        "9090c090c0c0c090a5616c6c6f79cb3ff4000000000000a36d703390dc0012c0cb3ff0000000000000cb"
        "3ff000000000000000cb0000000000000000c09090c200cb3ff0000000000000cb0000000000000000cb"
        "000000000000000080c2c200c20000",
    ),
    "abort": (Abort(["req-1", "req-2"]), "92a561626f727492a57265712d31a57265712d32"),
    "control": (
        Control(3, "stats", {"verbose": True}),
        "94a363746c03a5737461747381a7766572626f7365c3",
    ),
    "shutdown": (
        Shutdown(ShutdownMode.DRAIN, 2.5),
        "93a873687574646f776ea5647261696ecb4004000000000000",
    ),
    "rejoin": (Rejoin("x"), "93a672656a6f696ea178ff"),
    "refuse": (Refuse("no"), "92a6726566757365a26e6f"),
}


def heartbeat(**appended: Any) -> Heartbeat:
    """The golden heartbeat; `appended`: fields added after the first version."""
    return Heartbeat("w1", WorkerState.READY, 17, 1, 0, 1024, 2048, 512, 4096, **appended)


FROM_WORKER = {
    "hello": (Hello("w1", 1, 4242, "demo"), "96a568656c6c6fa2773101cd1092a464656d6f00"),
    "ready": (
        Ready("w1", Capacity(64, 256, 2048), {"mlx": "0.32.4"}, ["chat"], 1.25),
        # 9a (99 before identity, 96 before device, device_memory_bytes, prefix_cache_bytes)
        "9aa57265616479a277319340cd0100cd080081a36d6c78a6302e33322e3491a463686174cb3ff40000"
        "00000000a00000a0",
    ),
    "ready_device": (
        Ready(
            "w1",
            Capacity(64, 256, 2048),
            {"mlx": "0.32.4"},
            ["chat"],
            1.25,
            "gpu",
            1 << 34,
            1 << 31,
        ),
        "9aa57265616479a277319340cd0100cd080081a36d6c78a6302e33322e3491a463686174cb3ff40000"
        "00000000a3677075cf0000000400000000ce80000000a0",
    ),
    "step": (
        STEP,
        # as V2_STEP, each RequestOutput a 16-array (dc0010; 9d in v5, 9b in v4, 96 in v2, 9a
        # before timings were appended) ending 90 90 c0 c0 c0 a0 90 c4 00 00 90
        "96a473746570a277311192dc0014a57265712d31a368c3a99268cce9c0c0c09090c0c0c0a090c4000090"
        "90c0c400c0dc0014a57265712d32a090a56572726f72940501000093a8696e7465726e616ca4626f6f6d"
        "a1789090c0c0c0a090c400009090c0c400c00000",
    ),
    "step_logprobs": (
        STEP_LOGPROBS,
        "96a473746570a277311292dc0014a57265712d33a090a66c656e6774689403000000c090929500a26162"
        "c090c4009511a22063cbbff8000000000000929409a178cbbfe0000000000000c4009411a22063cbbff8"
        "000000000000c400c400a461622063c0c0a090c400009090c0c400c0dc0014a57265712d34a164910ca4"
        "73746f709404020000c092950ca164cbbfd000000000000091940ca164cbbfd0000000000000c40164c4"
        "0164950da3efbfbdcbbfe000000000000090c401c390c0a20a0ac0a090c400009090c0c400c00000",
    ),
    "step_tools": (
        STEP_TOOLS,
        "96a473746570a277311392dc0014a57265712d36a090c0c0c09090c0c0c0a2686d919400a663616c6c5f"
        "31a166a0c400009090c0c400c0dc0014a57265712d36a09107aa746f6f6c5f63616c6c73c0c09090c0c0"
        "c0a0919400a0a0a87b2261223a20317dc400009090c0c400c00000",
    ),
    "step_embed": (
        STEP_EMBED,
        "96a473746570a277311491dc0014a57265712d37a090a473746f709403000000c09090c0c0c0a090c410"
        "0000803f0000803f0000803f0000803f029090c0c400c00000",
    ),
    "step_speech": (
        STEP_SPEECH,
        "96a473746570a277311292dc0014a57265712d38ab68656c6c6f20776f726c6490a473746f70c0c09090"
        "c0c0c0a090c4000090919a00cb0000000000000000cb3ff8000000000000ac2068656c6c6f20776f726c"
        "6492cdc4bccd1e47cb0000000000000000cb0000000000000000cb0000000000000000cb000000000000"
        "00009193a568656c6c6fcb0000000000000000cb3fe6666666666666a2656ec400cb3ff8000000000000"
        "dc0014a57265712d39a090c0c0c09090c0c0c0a090c400009090c0c402fffbcb3fe00000000000000000",
    ),
    "heartbeat": (
        heartbeat(),
        # 9f (was 9c): prefix_cache (nil when absent), wired and cache limits appended
        "9fa26862a27731a57265616479110100cd0400cd0800cd0200cd1000a0cbbff0000000000000c00000",
    ),
    "heartbeat_prefix_cache": (
        heartbeat(prefix_cache=PrefixCacheStats(2, 4096, 8192, 5, 3, 300, 1)),
        "9fa26862a27731a57265616479110100cd0400cd0800cd0200cd1000a0cbbff0000000000000"
        "9702cd1000cd20000503cd012c010000",
    ),
    "heartbeat_limits": (
        heartbeat(wired_limit_bytes=1 << 34, cache_limit_bytes=1 << 32),
        "9fa26862a27731a57265616479110100cd0400cd0800cd0200cd1000a0cbbff0000000000000"
        "c0cf0000000400000000cf0000000100000000",
    ),
    "control_reply": (ControlReply("w1", 3, True, {"n": 1}), "96a463746c72a2773103c381a16e01c0"),
    "worker_dead": (
        WorkerDead("w1", "oom", "Traceback..."),
        "94a464656164a27731a36f6f6dac54726163656261636b2e2e2e",
    ),
}


@pytest.mark.parametrize("name", [*TO_WORKER, *FROM_WORKER])
def test_golden_bytes(name: str) -> None:
    frame, golden = {**TO_WORKER, **FROM_WORKER}[name]
    assert Codec().encode(frame).hex() == golden


@pytest.mark.parametrize("name", list(TO_WORKER))
def test_to_worker_round_trip(name: str) -> None:
    frame, golden = TO_WORKER[name]
    codec = Codec()
    decoded = codec.to_worker.decode(bytes.fromhex(golden))
    assert type(decoded) is type(frame)
    assert decoded == frame
    assert codec.encode(decoded).hex() == golden


@pytest.mark.parametrize("name", list(FROM_WORKER))
def test_from_worker_round_trip(name: str) -> None:
    frame, golden = FROM_WORKER[name]
    codec = Codec()
    decoded = codec.from_worker.decode(bytes.fromhex(golden))
    assert type(decoded) is type(frame)
    assert decoded == frame
    assert codec.encode(decoded).hex() == golden


def test_round_trip_keeps_nested_types() -> None:
    codec = Codec()
    add = codec.to_worker.decode(codec.encode(ADD))
    assert isinstance(add, Add)
    assert add.kind is RequestKind.CHAT
    assert add.request.messages[1] == Message("user", "Hi", name="bob")
    assert add.sampling.logit_bias == {5: -1.5}
    assert add.sampling.top_p == 1.0  # a default in the middle survives
    step = codec.from_worker.decode(codec.encode(STEP))
    assert isinstance(step, StepOutputs)
    terminal = step.outputs[1]
    assert terminal.finish_reason is FinishReason.ERROR
    assert terminal.usage == Usage(prompt_tokens=5, completion_tokens=1)
    assert terminal.error is not None and terminal.error.code is ErrorCode.INTERNAL


@pytest.mark.parametrize("name", list(FROM_WORKER))
def test_worker_frames_are_rejected_by_the_worker_decoder(name: str) -> None:
    with pytest.raises(msgspec.ValidationError):
        Codec().to_worker.decode(bytes.fromhex(FROM_WORKER[name][1]))


@pytest.mark.parametrize("name", list(TO_WORKER))
def test_gateway_frames_are_rejected_by_the_gateway_decoder(name: str) -> None:
    with pytest.raises(msgspec.ValidationError):
        Codec().from_worker.decode(bytes.fromhex(TO_WORKER[name][1]))


def test_round_trip_keeps_logprob_types() -> None:
    codec = Codec()
    add = codec.to_worker.decode(codec.encode(ADD_ECHO))
    assert isinstance(add, Add)
    assert add.kind is RequestKind.COMPLETION
    assert add.request.prompt_token_ids == [0, 17, 42]
    assert (add.sampling.logprobs, add.sampling.top_logprobs, add.sampling.echo) == (True, 5, True)
    assert add.sampling.max_tokens == 0 and add.priority == 1
    step = codec.from_worker.decode(codec.encode(STEP_LOGPROBS))
    assert isinstance(step, StepOutputs)
    scored, stopped = step.outputs
    assert scored.prompt_text == "ab c"
    first, second = scored.prompt_logprobs
    assert first == TokenLogprob(0, "ab") and first.logprob is None and first.top == []
    assert isinstance(second.top[0], TopLogprob)
    assert [t.token_id for t in second.top] == [9, 17]
    assert scored.logprobs == [] and scored.stop is None
    assert stopped.stop == "\n\n"
    assert stopped.logprobs[0] == TokenLogprob(
        12, "d", -0.25, [TopLogprob(12, "d", -0.25, b"d")], b"d"
    )
    assert stopped.logprobs[1].token_bytes == b"\xc3"  # a byte token keeps its own byte
    assert stopped.prompt_logprobs == [] and stopped.prompt_text is None


def test_protocol_2_frames_decode_with_the_new_fields_defaulted() -> None:
    """A protocol-2 peer's Add and StepOutputs (shorter arrays) still decode: append-only."""
    codec = Codec()
    add = codec.to_worker.decode(bytes.fromhex(V2_ADD))
    assert add == ADD
    assert isinstance(add, Add)
    assert (add.sampling.logprobs, add.sampling.top_logprobs, add.sampling.echo) == (
        False,
        0,
        False,
    )
    step = codec.from_worker.decode(bytes.fromhex(V2_STEP))
    assert step == STEP
    assert isinstance(step, StepOutputs)
    for output in step.outputs:
        assert output.logprobs == [] and output.prompt_logprobs == []
        assert output.prompt_text is None and output.stop is None and output.timings is None
    # ... and the new bytes only append to the old ones' arrays
    new = msgspec.msgpack.decode(codec.encode(ADD))
    old = msgspec.msgpack.decode(bytes.fromhex(V2_ADD))
    assert new[4][: len(old[4])] == old[4] and new[4][len(old[4]) :] == [False, 0, False]
    new = msgspec.msgpack.decode(codec.encode(STEP))
    old = msgspec.msgpack.decode(bytes.fromhex(V2_STEP))
    for new_output, old_output in zip(new[3], old[3], strict=True):
        for i, (new_field, old_field) in enumerate(zip(new_output, old_output, strict=False)):
            if i == 4 and isinstance(old_field, list):  # Usage appended reasoning_tokens
                assert new_field[: len(old_field)] == old_field
            else:
                assert new_field == old_field
        appended = [[], [], None, None, None, "", [], b"", 0, [], [], None, b"", None]
        assert new_output[len(old_output) :] == appended


def test_protocol_version_is_an_int() -> None:
    assert type(PROTOCOL_VERSION) is int
    assert PROTOCOL_VERSION == 11  # bumped with sessions (a remote worker that joins again)
    hello = Codec().from_worker.decode(Codec().encode(Hello("w", PROTOCOL_VERSION, 1, "m")))
    assert isinstance(hello, Hello)
    assert hello.protocol_version == PROTOCOL_VERSION


class _OldFrame(msgspec.Struct, array_like=True, omit_defaults=True, tag_field="t", tag="x"):
    request_id: str
    count: int = 0


class _NewFrame(msgspec.Struct, array_like=True, omit_defaults=True, tag_field="t", tag="x"):
    request_id: str
    count: int = 0
    priority: int = 5  # appended, with a default


class _ReorderedFrame(msgspec.Struct, array_like=True, omit_defaults=True, tag_field="t", tag="x"):
    count: int = 0
    request_id: str = ""


def test_appending_a_defaulted_field_keeps_old_bytes_decodable() -> None:
    old_bytes = msgspec.msgpack.encode(_OldFrame("r1", 3))
    new = msgspec.msgpack.decode(old_bytes, type=_NewFrame)
    assert new == _NewFrame("r1", 3, 5)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(_OldFrame("r1")), type=_NewFrame) == (
        _NewFrame("r1", 0, 5)
    )
    # old readers ignore trailing fields they do not know
    newer_bytes = msgspec.msgpack.encode(_NewFrame("r1", 3, 9))
    assert msgspec.msgpack.decode(newer_bytes, type=_OldFrame) == _OldFrame("r1", 3)


def test_reordering_fields_breaks_old_bytes() -> None:
    """Why the rule is 'append only': array_like frames are positional."""
    old_bytes = msgspec.msgpack.encode(_OldFrame("r1", 3))
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(old_bytes, type=_ReorderedFrame)


def test_shorter_frames_from_an_older_peer_decode_with_defaults() -> None:
    """A Ready/Heartbeat from a peer that predates the trailing fields still decodes."""
    codec = Codec()
    ready = codec.from_worker.decode(msgspec.msgpack.encode(["ready", "w1", [8, 16, 512]]))
    assert ready == Ready("w1", Capacity(8, 16, 512))
    assert ready.versions == {} and ready.capabilities == [] and ready.load_time_s == 0.0
    assert ready.identity == ""  # a v9 worker's Ready: no identity
    hb = codec.from_worker.decode(msgspec.msgpack.encode(["hb", "w1", "draining", 3, 2, 1]))
    assert hb == Heartbeat("w1", WorkerState.DRAINING, 3, 2, 1, memory_bytes=0)
    shutdown = codec.to_worker.decode(msgspec.msgpack.encode(["shutdown"]))
    assert shutdown == Shutdown(ShutdownMode.ABORT, 10.0)


def test_protocol_3_messages_decode_with_the_new_fields_defaulted() -> None:
    codec = Codec()
    add = codec.to_worker.decode(bytes.fromhex(V3_ADD))
    assert add == ADD
    rich = codec.to_worker.decode(codec.encode(ADD_RICH))
    assert isinstance(rich, Add)
    user, assistant, tool = rich.request.messages
    assert [type(p) for p in user.parts] == [TextPart, ImagePart, ImagePart, AudioPart]
    assert assistant.tool_calls[0].name == "get_weather"
    assert (assistant.extras(), tool.extras()) == (["tool_calls", "reasoning"], ["tool_call_id"])
    assert user.extras() == ["parts"] and Message("user", "hi").extras() == []


def test_protocol_5_frames_decode_with_the_new_fields_defaulted() -> None:
    codec = Codec()
    assert codec.to_worker.decode(bytes.fromhex(V5_ADD)) == ADD
    assert codec.from_worker.decode(bytes.fromhex(V5_STEP)) == STEP
    add = codec.to_worker.decode(codec.encode(ADD_EMBED))
    assert isinstance(add, Add) and add.kind is RequestKind.EMBEDDING
    assert add.request.inputs == ["a", "b c"] and add.request.input_token_ids == []
    step = codec.from_worker.decode(codec.encode(STEP_EMBED))
    assert isinstance(step, StepOutputs)
    [output] = step.outputs
    assert output.dimensions == 2 and len(output.embeddings) == 16


def test_protocol_4_frames_decode_with_the_new_fields_defaulted() -> None:
    codec = Codec()
    assert codec.to_worker.decode(bytes.fromhex(V4_ADD)) == ADD
    assert codec.from_worker.decode(bytes.fromhex(V4_STEP)) == STEP
    tools = codec.to_worker.decode(codec.encode(ADD_TOOLS))
    assert isinstance(tools, Add)
    assert tools.request.needs() == ["tools", "structured_output", "reasoning"]
    assert tools.request.tool_choice == ToolChoice(ToolChoiceMode.REQUIRED, "get_weather", False)
    step = codec.from_worker.decode(codec.encode(STEP_TOOLS))
    assert isinstance(step, StepOutputs)
    assert step.outputs[1].finish_reason is FinishReason.TOOL_CALLS
    assert step.outputs[0].tool_calls == [ToolCallDelta(0, "call_1", "f")]


def test_protocol_7_frames_decode_with_the_new_fields_defaulted() -> None:
    codec = Codec()
    assert codec.to_worker.decode(bytes.fromhex(V7_ADD)) == ADD
    assert codec.from_worker.decode(bytes.fromhex(V7_STEP)) == STEP
    add = codec.to_worker.decode(codec.encode(ADD_TRANSCRIBE))
    assert isinstance(add, Add) and add.kind is RequestKind.TRANSCRIPTION
    assert add.request.audio == AudioPart(b"RIFF", format="wav")
    assert add.request.timestamps == ["segment", "word"]
    step = codec.from_worker.decode(codec.encode(STEP_SPEECH))
    assert isinstance(step, StepOutputs)
    transcript, audio = step.outputs
    assert transcript.segments[0].words == [Word("hello", 0.0, 0.7)]
    assert audio.audio == b"\xff\xfb" and audio.duration == 0.5


def test_protocol_8_frames_decode_with_nothing_resumed() -> None:
    codec = Codec()
    add = codec.to_worker.decode(bytes.fromhex(V8_ADD))
    assert add == ADD and isinstance(add, Add) and add.request.resumed == []
    resumed = msgspec.structs.replace(ADD, request=CanonicalRequest(prompt="x", resumed=[5, 6]))
    back = codec.to_worker.decode(codec.encode(resumed))
    assert isinstance(back, Add) and back.request.resumed == [5, 6]
