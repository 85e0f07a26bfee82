"""Fuzzed wire frames (issue 24): random bytes, truncated and bit-flipped frames, frames of a
later protocol or an unknown tag. Either side's decoder gives a frame or raises one of
UNDECODABLE (which the gateway's reader and the worker's input thread log and drop):
msgspec.DecodeError, or RecursionError for msgpack nested past msgspec's depth limit;
nothing else ever escapes, and every golden frame still decodes to itself. Bad frames on
the real sockets of real processes: tests/test_e2e_wire.py."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.protocol import UNDECODABLE, Codec
from tests.test_protocol import FROM_WORKER, TO_WORKER

GOLDEN = [bytes.fromhex(h) for _, h in [*TO_WORKER.values(), *FROM_WORKER.values()]]
FUZZ = settings(max_examples=300, deadline=None, derandomize=True)


def decodes_or_refuses(raw: bytes) -> None:
    codec = Codec()
    for decoder in (codec.to_worker, codec.from_worker):
        with contextlib.suppress(*UNDECODABLE):  # ValidationError is a DecodeError too
            decoder.decode(raw)


@FUZZ
@given(st.binary(max_size=256))
def test_random_bytes(raw: bytes) -> None:
    decodes_or_refuses(raw)


@FUZZ
@given(st.sampled_from(GOLDEN), st.data())
def test_truncated_and_flipped_golden_frames(frame: bytes, data: st.DataObject) -> None:
    cut = data.draw(st.integers(0, len(frame)))
    decodes_or_refuses(frame[:cut])
    flips = data.draw(st.lists(st.integers(0, len(frame) - 1), min_size=1, max_size=4))
    mutated = bytearray(frame)
    for i in flips:
        mutated[i] ^= data.draw(st.integers(1, 255))
    decodes_or_refuses(bytes(mutated))


@FUZZ
@given(
    st.sampled_from(["add", "abort", "step", "ready", "hello", "nonsense", ""]),
    st.lists(
        st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8)
        | st.binary(max_size=8) | st.lists(st.integers(-(2**63), 2**64 - 1), max_size=3),
        max_size=12,
    ),
)  # fmt: skip
def test_tagged_arrays_of_any_fields(tag: str, fields: list[object]) -> None:
    """A peer of another protocol version: known or unknown tags, fields of any type and
    number (a later version's frames are longer)."""
    decodes_or_refuses(msgspec.msgpack.encode([tag, *fields]))


@pytest.mark.parametrize(
    "raw",
    [
        b"\x94\xa3ctl\x01\xa5stats\x81\xa1a" + b"\x91" * 100_000 + b"\xc0",  # Control.args
        b"\x96\xa4ctlr\xa1w\x03\xc3\x81\xa1a" + b"\x91" * 100_000 + b"\xc0\xc0",  # .result
    ],
)
def test_frames_nested_too_deep_are_refused(raw: bytes) -> None:
    """An Any field takes msgpack nested without end: msgspec stops with RecursionError,
    not DecodeError, so both sides catch UNDECODABLE."""
    codec = Codec()
    errors = []
    for decoder in (codec.to_worker, codec.from_worker):
        with pytest.raises(UNDECODABLE) as caught:
            decoder.decode(raw)
        errors.append(caught.type)
    assert RecursionError in errors


@pytest.mark.parametrize("raw", GOLDEN)
def test_every_golden_frame_decodes_on_its_side(raw: bytes) -> None:
    codec = Codec()
    decoded = []
    for decoder in (codec.to_worker, codec.from_worker):
        with contextlib.suppress(msgspec.DecodeError):
            decoded.append(decoder.decode(raw))
    assert len(decoded) == 1  # each frame belongs to exactly one direction
    assert codec.encode(decoded[0]) == raw
