"""RequestStream: deltas merge while the reader is slow; exactly one terminal event."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.workers.stream import RequestStream
from shared.types import (
    ErrorCode,
    FinishReason,
    RequestOutput,
    Segment,
    Timings,
    TokenLogprob,
    ToolCallDelta,
    Usage,
)


def out(text: str = "", ids: list[int] | None = None, **kwargs: object) -> RequestOutput:
    return RequestOutput("r1", text=text, token_ids=ids or [], **kwargs)  # type: ignore[arg-type]


def test_slow_reader_gets_merged_deltas() -> None:
    async def main() -> list[RequestOutput]:
        stream = RequestStream("r1", "m", "w1")
        got = []
        stream.put(out("He", [1]))
        stream.put(out("llo", [2, 3]))
        got.append(await stream.get())
        stream.put(out(" wor", [4]))
        stream.put(out("ld", [5]))
        usage = Usage(prompt_tokens=7, completion_tokens=6)
        stream.put(out("!", [6], finish_reason=FinishReason.STOP, usage=usage))
        got.append(await stream.get())
        return got

    first, last = asyncio.run(main())
    assert (first.text, first.token_ids, first.finish_reason) == ("Hello", [1, 2, 3], None)
    assert last.request_id == "r1"
    assert last.text == " world!"
    assert last.token_ids == [4, 5, 6]
    assert last.finish_reason is FinishReason.STOP
    assert last.usage == Usage(prompt_tokens=7, completion_tokens=6)


def test_usage_from_an_earlier_delta_survives_the_merge() -> None:
    async def main() -> RequestOutput:
        stream = RequestStream("r1", "m", "w1")
        stream.put(out("a", [1], usage=Usage(1, 1)))
        stream.put(out("b", [2], finish_reason=FinishReason.LENGTH))
        return await stream.get()

    merged = asyncio.run(main())
    assert merged.usage == Usage(1, 1)
    assert (merged.text, merged.token_ids, merged.finish_reason) == ("ab", [1, 2], "length")


def test_first_token_timings_survive_the_merge() -> None:
    async def main() -> RequestOutput:
        stream = RequestStream("r1", "m", "w1")
        stream.put(out("a", [1], timings=Timings(0.001, 0.02, 0.03)))
        stream.put(out("b", [2]))
        return await stream.get()

    assert asyncio.run(main()).timings == Timings(0.001, 0.02, 0.03)


def test_reader_waiting_before_the_put_is_woken() -> None:
    async def main() -> list[RequestOutput]:
        stream = RequestStream("r1", "m", "w1")

        async def producer() -> None:
            for i in range(3):
                await asyncio.sleep(0)
                stream.put(out(str(i), [i]))
            stream.put(out(finish_reason=FinishReason.STOP, usage=Usage(1, 3)))

        task = asyncio.create_task(producer())
        got = []
        while True:
            output = await asyncio.wait_for(stream.get(), timeout=5)
            got.append(output)
            if output.finish_reason is not None:
                break
        await task
        return got

    got = asyncio.run(main())
    assert "".join(o.text for o in got) == "012"
    assert [t for o in got for t in o.token_ids] == [0, 1, 2]
    assert [o.finish_reason for o in got].count(FinishReason.STOP) == 1
    assert got[-1].usage == Usage(1, 3)


def test_exactly_one_terminal_event() -> None:
    async def main() -> tuple[RequestStream, RequestOutput]:
        stream = RequestStream("r1", "m", "w1")
        stream.put(out("x", [1], finish_reason=FinishReason.STOP, usage=Usage(2, 1)))
        stream.put(out("late", [9]))
        stream.put(out("", finish_reason=FinishReason.ABORT))
        stream.fail(ErrorCode.WORKER_DIED, "gone")
        terminal = await stream.get()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(stream.get(), timeout=0.05)
        return stream, terminal

    stream, terminal = asyncio.run(main())
    assert stream.finished
    assert (terminal.text, terminal.token_ids) == ("x", [1])
    assert terminal.finish_reason is FinishReason.STOP
    assert terminal.error is None


def test_fail_produces_an_error_terminal() -> None:
    async def main() -> RequestOutput:
        stream = RequestStream("r1", "m", "w1")
        stream.put(out("partial", [1, 2]))
        stream.fail(ErrorCode.WORKER_DIED, "the worker died")
        stream.fail(ErrorCode.TIMEOUT, "second failure is ignored")
        return await stream.get()

    terminal = asyncio.run(main())
    assert terminal.finish_reason is FinishReason.ERROR
    assert terminal.error is not None
    assert terminal.error.code is ErrorCode.WORKER_DIED
    assert terminal.error.message == "the worker died"
    assert (terminal.text, terminal.token_ids) == ("partial", [1, 2])  # merged, not lost


def test_fail_alone() -> None:
    async def main() -> tuple[bool, RequestOutput]:
        stream = RequestStream("r9", "m", "w1")
        stream.fail(ErrorCode.TIMEOUT, "too slow")
        return stream.finished, await stream.get()

    finished, terminal = asyncio.run(main())
    assert finished
    assert terminal.request_id == "r9"
    assert terminal.finish_reason is FinishReason.ERROR
    assert terminal.error is not None and terminal.error.code is ErrorCode.TIMEOUT


def test_audio_and_a_transcripts_fields_survive_the_merge() -> None:
    """Speech audio made faster than the client reads it is joined, never dropped; a
    transcription's segments, language and duration keep through a merge too."""

    async def main() -> RequestOutput:
        stream = RequestStream("r1", "m", "w1")
        stream.put(out(audio=b"ab"))
        stream.put(out(audio=b"cd", segments=[Segment(0, 0.0, 1.0, "x")], language="en"))
        stream.put(out(audio=b"e", finish_reason=FinishReason.STOP, duration=1.5))
        return await stream.get()

    merged = asyncio.run(main())
    assert (merged.audio, merged.language, merged.duration) == (b"abcde", "en", 1.5)
    assert [s.text for s in merged.segments] == ["x"]


def test_every_field_survives_a_long_merge_and_the_first_delta_is_left_alone() -> None:
    first = out("a", [1], logprobs=[TokenLogprob(1, "a", -0.5)], timings=Timings(0, 0, 0.1))
    deltas = [
        first,
        out("b", [2], reasoning="r1", tool_calls=[ToolCallDelta(0, "c1", "f", "{")]),
        out("", [3], reasoning="r2", tool_calls=[ToolCallDelta(0, arguments="}")]),
        out(embeddings=b"\x01\x02", dimensions=2, scores=[0.5]),
        out("c", [4], finish_reason=FinishReason.STOP, usage=Usage(3, 4), stop="zz"),
    ]

    async def main() -> RequestOutput:
        stream = RequestStream("r1", "m", "w1")
        for delta in deltas:
            stream.put(delta)
        return await stream.get()

    merged = asyncio.run(main())
    assert (merged.text, merged.reasoning, merged.token_ids) == ("abc", "r1r2", [1, 2, 3, 4])
    assert [(c.index, c.arguments) for c in merged.tool_calls] == [(0, "{"), (0, "}")]
    assert (merged.embeddings, merged.dimensions, merged.scores) == (b"\x01\x02", 2, [0.5])
    assert (merged.finish_reason, merged.usage, merged.stop) == ("stop", Usage(3, 4), "zz")
    assert merged.timings == Timings(0, 0, 0.1) and len(merged.logprobs) == 1
    # what the worker's frame held is not changed under it
    assert (first.text, first.token_ids, len(first.logprobs)) == ("a", [1], 1)


def test_a_reader_that_stops_reading_costs_little_per_delta() -> None:
    """A client that never reads its stream: the deltas pile up unread for as long as the
    request runs. Adding one must not copy all the others (that was quadratic: ~30 s of
    the gateway's event loop for these 100,000 deltas; appended in place it is ~0.2 s)."""

    async def main() -> RequestOutput:
        stream = RequestStream("r1", "m", "w1")
        start = time.perf_counter()
        for i in range(100_000):
            stream.put(out("tok ", [i]))
        assert time.perf_counter() - start < 3.0
        return await stream.get()

    merged = asyncio.run(main())
    assert len(merged.text) == 400_000 and merged.token_ids == list(range(100_000))
