"""Wire frames' pinned bytes: every frame to and from a worker encodes to its golden bytes
and decodes back to itself, and each direction's decoder rejects the other direction's
frames."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from shared.protocol import (
    Abort,
    Add,
    Capacity,
    Codec,
    Control,
    ControlReply,
    Heartbeat,
    Hello,
    PrefixCacheStats,
    PromptSegmentStats,
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
    ErrorCode,
    FinishReason,
    Message,
    RequestKind,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from tests.protocol_frames import (
    ADD,
    ADD_ECHO,
    ADD_EMBED,
    ADD_RICH,
    ADD_SPEECH,
    ADD_TOOLS,
    ADD_TRANSCRIBE,
    STEP,
    STEP_EMBED,
    STEP_LOGPROBS,
    STEP_SPEECH,
    STEP_TOOLS,
)

TO_WORKER = {
    "add": (
        ADD,
        # as V3_ADD (test_protocol_compat.py), each Message a 7-array (97, was 93) ending
        # 90 90 c0 c0; the request an 14-array (9e; 99 in v5, 95 before) ending 90 c0 c0 c0
        # 90 90 c0 90 c0
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
        # its Reasoning a 4-array (94, 93 in v12): `advisory` (c2) appended
        "97a3616464a57265712d36a463686174dc00159197a475736572a8576561746865723fc09090c0c0c0c0"
        "c3809194ab6765745f77656174686572aa4c6f6f6b20697420757081a474797065a66f626a656374c393"
        "a87265717569726564ab6765745f77656174686572c295ab6a736f6e5f736368656d6181a474797065a6"
        "6f626a656374a177c2af726573706f6e73655f666f726d617494c340c0c29090c090c0c0c090c0c0c090"
        "dc0012c0cb3ff0000000000000cb3ff000000000000000cb0000000000000000c09090c200cb3ff00000"
        "00000000cb0000000000000000cb000000000000000080c2c200c20000",
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
        # as V2_STEP (test_protocol_compat.py), each RequestOutput a 16-array (dc0010; 9d in
        # v5, 9b in v4, 96 in v2, 9a before timings were appended) ending 90 90 c0 c0 c0 a0 90
        # c4 00 00 90; its RequestError a 4-array (94, 93 in v12): context figures (90)
        "96a473746570a277311192dc0014a57265712d31a368c3a99268cce9c0c0c09090c0c0c0a090c4000090"
        "90c0c400c0dc0014a57265712d32a090a56572726f72940501000094a8696e7465726e616ca4626f6f6d"
        "a178909090c0c0c0a090c400009090c0c400c00000",
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
        # dc0010 (9f in v11, 9c before): prefix_cache (nil when absent), wired and cache
        # limits, then prompt_segments (nil when absent) appended
        "dc0010a26862a27731a57265616479110100cd0400cd0800cd0200cd1000a0cbbff0000000000000c00000c0",
    ),
    "heartbeat_prefix_cache": (
        # protocol 14 appended oversize (the last 00 of the inner array, 98 long: 97 before)
        heartbeat(prefix_cache=PrefixCacheStats(2, 4096, 8192, 5, 3, 300, 1)),
        "dc0010a26862a27731a57265616479110100cd0400cd0800cd0200cd1000a0cbbff0000000000000"
        "9802cd1000cd20000503cd012c01000000c0",
    ),
    "heartbeat_limits": (
        heartbeat(wired_limit_bytes=1 << 34, cache_limit_bytes=1 << 32),
        "dc0010a26862a27731a57265616479110100cd0400cd0800cd0200cd1000a0cbbff0000000000000"
        "c0cf0000000400000000cf0000000100000000c0",
    ),
    "heartbeat_prompt_segments": (
        heartbeat(prompt_segments=PromptSegmentStats(3, 600, 4_000_000, 2, 5, 4, 1)),
        "dc0010a26862a27731a57265616479110100cd0400cd0800cd0200cd1000a0cbbff0000000000000"
        "c000009703cd0258ce003d090002050401",
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
