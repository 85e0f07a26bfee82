"""RequestStream: deltas merge while the reader is slow; exactly one terminal event."""

from __future__ import annotations

import asyncio

import pytest

from gateway.workers.stream import RequestStream
from shared.types import ErrorCode, FinishReason, RequestOutput, Segment, Timings, Usage


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
