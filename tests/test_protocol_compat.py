"""Append-only evolution of the wire frames: older protocols' bytes still decode, with the
fields appended since defaulted; new bytes only append to old arrays; reordering fields
would break old bytes; and the protocol version is an int."""

from __future__ import annotations

import msgspec
import pytest

from shared.protocol import (
    PROTOCOL_VERSION,
    Add,
    Capacity,
    Codec,
    Heartbeat,
    Hello,
    PrefixCacheStats,
    PromptSegmentStats,
    Ready,
    Shutdown,
    ShutdownMode,
    StepOutputs,
    WorkerState,
)
from shared.types import (
    AudioPart,
    CanonicalRequest,
    FinishReason,
    ImagePart,
    Message,
    RequestKind,
    TextPart,
    ToolCallDelta,
    ToolChoice,
    ToolChoiceMode,
    Word,
)
from tests.protocol_frames import (
    ADD,
    ADD_EMBED,
    ADD_RICH,
    ADD_TOOLS,
    ADD_TRANSCRIBE,
    STEP,
    STEP_EMBED,
    STEP_SPEECH,
    STEP_TOOLS,
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

# Protocol 8's bytes for ADD, before CanonicalRequest gained `resumed`.
V8_ADD = (
    "96a3616464a57265712d31a463686174dc00149297a673797374656da942652062726965662ec09090c0"
    "c097a475736572a24869a3626f629090c0c0c0c0c38090c0c0c09090c090c0c0c090c0c0c0dc001220cb"
    "3fe0000000000000cb3ff000000000000000cb00000000000000000791a20a0a9102c200cb3ff0000000"
    "000000cb0000000000000000cb00000000000000008105cbbff8000000000000c2c200c200"
)

# Protocol 12's bytes for an Add with tools, a response format and thinking (a Reasoning of
# three fields), before Reasoning gained `advisory`.
V12_ADD_TOOLS = (
    "97a3616464a57265712d36a463686174dc00159197a475736572a8576561746865723fc09090c0c0c0c0"
    "c3809194ab6765745f77656174686572aa4c6f6f6b20697420757081a474797065a66f626a656374c393"
    "a87265717569726564ab6765745f77656174686572c295ab6a736f6e5f736368656d6181a474797065a6"
    "6f626a656374a177c2af726573706f6e73655f666f726d617493c340c09090c090c0c0c090c0c0c090dc"
    "0012c0cb3ff0000000000000cb3ff000000000000000cb0000000000000000c09090c200cb3ff0000000"
    "000000cb0000000000000000cb000000000000000080c2c200c20000"
)


def test_protocol_12_reasoning_decodes_as_not_advisory() -> None:
    add = Codec().to_worker.decode(bytes.fromhex(V12_ADD_TOOLS))
    assert isinstance(add, Add) and add == ADD_TOOLS
    assert add.request.reasoning is not None and add.request.reasoning.advisory is False


# Protocol 11's bytes for a Heartbeat with a prefix cache, before it gained prompt_segments.
V11_HEARTBEAT = (
    "9fa26862a27731a57265616479110100cd0400cd0800cd0200cd1000a0cbbff0000000000000"
    "9702cd1000cd20000503cd012c010000"
)


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
            # Usage appended reasoning_tokens, RequestError its context figures (v13)
            if i in (4, 5) and isinstance(old_field, list):
                assert new_field[: len(old_field)] == old_field
            else:
                assert new_field == old_field
        appended = [[], [], None, None, None, "", [], b"", 0, [], [], None, b"", None]
        assert new_output[len(old_output) :] == appended


def test_protocol_version_is_an_int() -> None:
    assert type(PROTOCOL_VERSION) is int
    assert PROTOCOL_VERSION == 14  # bumped with the prefix cache's oversize count
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


# Protocol 13's bytes for a Heartbeat with a prefix cache, before its stats gained oversize.
V13_HEARTBEAT = (
    "dc0010a26862a27731a57265616479110100cd0400cd0800cd0200cd1000a0cbbff0000000000000"
    "9702cd1000cd20000503cd012c010000c0"
)


def test_protocol_13_heartbeats_decode_with_nothing_oversize() -> None:
    codec = Codec()
    hb = codec.from_worker.decode(bytes.fromhex(V13_HEARTBEAT))
    assert isinstance(hb, Heartbeat) and hb.prefix_cache is not None
    assert hb.prefix_cache == PrefixCacheStats(2, 4096, 8192, 5, 3, 300, 1, oversize=0)
    # ... and the new bytes only append to the old stats' array
    new = msgspec.msgpack.decode(codec.encode(hb))
    before = msgspec.msgpack.decode(bytes.fromhex(V13_HEARTBEAT))
    at = before.index([2, 4096, 8192, 5, 3, 300, 1])
    assert new[:at] == before[:at] and new[at] == [*before[at], 0]
    assert new[at + 1 :] == before[at + 1 :]


def test_protocol_11_heartbeats_decode_with_no_prompt_segments() -> None:
    codec = Codec()
    hb = codec.from_worker.decode(bytes.fromhex(V11_HEARTBEAT))
    cache = PrefixCacheStats(2, 4096, 8192, 5, 3, 300, 1)
    old = Heartbeat("w1", WorkerState.READY, 17, 1, 0, 1024, 2048, 512, 4096, prefix_cache=cache)
    assert hb == old and isinstance(hb, Heartbeat) and hb.prompt_segments is None
    # ... and the new bytes only append to the old array
    memo = PromptSegmentStats(3, 600, 4_000_000, 2, 5, 4, 1)
    new = msgspec.msgpack.decode(codec.encode(msgspec.structs.replace(old, prompt_segments=memo)))
    before = msgspec.msgpack.decode(bytes.fromhex(V11_HEARTBEAT))
    # (protocol 14 appended oversize to the prefix cache's stats: a 0 at their end)
    before = [[*x, 0] if x == [2, 4096, 8192, 5, 3, 300, 1] else x for x in before]
    assert new[: len(before)] == before and new[len(before) :] == [[3, 600, 4_000_000, 2, 5, 4, 1]]
