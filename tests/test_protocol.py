"""Wire frames: pinned bytes, round trips, direction checks and append-only evolution."""

from __future__ import annotations

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
    Ready,
    Shutdown,
    ShutdownMode,
    StepOutputs,
    WorkerDead,
    WorkerState,
)
from shared.types import (
    CanonicalRequest,
    ErrorCode,
    FinishReason,
    Message,
    RequestError,
    RequestKind,
    RequestOutput,
    SamplingParams,
    Usage,
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

TO_WORKER = {
    "add": (
        ADD,
        "96a3616464a57265712d31a463686174959293a673797374656da942652062726965662ec093a4757365"
        "72a24869a3626f62c0c0c3809f20cb3fe0000000000000cb3ff000000000000000cb0000000000000000"
        "0791a20a0a9102c200cb3ff0000000000000cb0000000000000000cb00000000000000008105cbbff800"
        "0000000000c200",
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
}
FROM_WORKER = {
    "hello": (Hello("w1", 1, 4242, "demo"), "95a568656c6c6fa2773101cd1092a464656d6f"),
    "ready": (
        Ready("w1", Capacity(64, 256, 2048), {"mlx": "0.32.4"}, ["chat"], 1.25),
        "96a57265616479a277319340cd0100cd080081a36d6c78a6302e33322e3491a463686174cb3ff40000"
        "00000000",
    ),
    "step": (
        STEP,
        "94a473746570a27731119296a57265712d31a368c3a99268cce9c0c0c096a57265712d32a090a5657272"
        "6f729305010093a8696e7465726e616ca4626f6f6da178",
    ),
    "heartbeat": (
        Heartbeat("w1", WorkerState.READY, 17, 1, 0, 1024, 2048, 512, 4096),
        "9ca26862a27731a57265616479110100cd0400cd0800cd0200cd1000a0cbbff0000000000000",
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


def test_protocol_version_is_an_int() -> None:
    assert type(PROTOCOL_VERSION) is int
    assert PROTOCOL_VERSION >= 1
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
    hb = codec.from_worker.decode(msgspec.msgpack.encode(["hb", "w1", "draining", 3, 2, 1]))
    assert hb == Heartbeat("w1", WorkerState.DRAINING, 3, 2, 1, memory_bytes=0)
    shutdown = codec.to_worker.decode(msgspec.msgpack.encode(["shutdown"]))
    assert shutdown == Shutdown(ShutdownMode.ABORT, 10.0)
