"""worker/steptrace.py: the engine's steps timed, on a real tiny model; and its summary
(benchmarks/step_trace.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks import step_trace
from benchmarks.step_trace import per_level, read_traces, starts, summarize
from tests.engine_fixtures import Loaded, drive, greedy, reference_greedy, token_ids
from worker import steptrace
from worker.steptrace import STEP_TRACE_ENV, StepTrace

pytestmark = pytest.mark.usefixtures("batcher")


def test_unset_leaves_the_engine_alone(chat: Loaded) -> None:
    engine = chat.engine()
    assert StepTrace.wrap(engine, {}) is engine


def test_each_step_is_one_line_and_tokens_are_unchanged(
    chat: Loaded, prompts: list[list[int]], tmp_path: Path
) -> None:
    engine = StepTrace.wrap(chat.engine(), {STEP_TRACE_ENV: str(tmp_path / "trace")})
    decode = getattr(getattr(engine.backend, "batch", None), "decode", None)
    known = set(decode.row_counts) if decode is not None else set()  # its probe's, at load
    out = drive(engine, [greedy("a", prompts[0], 6, ignore_eos=True)])
    drive(engine, [greedy(f"b{i}", p, 4, ignore_eos=True) for i, p in enumerate(prompts[1:4])])
    assert token_ids(out["a"]) == reference_greedy(chat.model, prompts[0], 6)
    [trace] = read_traces(tmp_path / "trace").values()  # flushed when the engine went idle
    assert len(trace) == engine.steps
    (
        t,
        step_ms,
        backend_ms,
        inserted,
        insert_ms,
        rows,
        outputs,
        masked,
        shapes,
        waits,
        ahead,
        batch_rows,
        kv,
        prefilled,
        joined,
        cpu_ms,
        voluntary,
        involuntary,
        cache_mb,
        settle_ms,
    ) = zip(*trace, strict=True)
    assert list(t) == sorted(t)
    assert all(s >= b >= 0 for s, b in zip(step_ms, backend_ms, strict=True))
    # one thread's CPU time within a step is at most the step's wall time (to the rounding)
    assert all(0 <= c <= s + 0.01 for c, s in zip(cpu_ms, step_ms, strict=True))
    assert sum(cpu_ms) > 0
    if sys.platform == "linux":  # which counts context switches per thread
        assert all(isinstance(n, int) and n >= 0 for n in voluntary + involuntary)
    else:  # macOS does not: None
        assert all(n is None or n >= 0 for n in voluntary + involuntary)
    assert all(mb >= 0 for mb in cache_mb)
    # each step settled once its outputs were out (drive does as the worker does): where a
    # request finished (the last step's rows leaving, their KV going into the prefix cache)
    # it had work, timed; where nothing was put off, None
    assert settle_ms[-1] is not None and settle_ms[-1] > 0 and None in settle_ms
    assert all(ms is None or ms > 0 for ms in settle_ms)
    assert inserted[0] == 1 and sum(inserted) == 4  # the lone request, then the three
    assert all(ms > 0 for ms, n in zip(insert_ms, inserted, strict=True) if n)
    assert sum(outputs) == 6 + 3 * 4
    assert rows[-1] == 0 and max(rows) == 3
    if not hasattr(engine.backend, "batch"):  # BatchGenerator: none is known
        assert set(masked) == {None} and set(shapes) == {0} and set(waits) == {None}
        assert set(ahead) == {None} and set(batch_rows) == {None} and set(kv) == {None}
        assert set(prefilled) == {None} and set(joined) == {None}
    else:  # no first token was pending at a join: no call only read tokens
        assert set(ahead) == {0}
        # the three prompts are of different lengths: masked steps among them
        assert set(masked) <= {0, 1} and 1 in masked
        assert all(0 <= w <= b for w, b in zip(waits, backend_ms, strict=True))
        assert sum(waits) > 0
        # the lone request: one row; its KV its prompt but the last token and the token
        # before (first tokens from the next step), or all of it and two (from the prefill)
        from_prefill = 1 if engine.backend.batch.first is not None else 0
        assert batch_rows[1] == 1 and kv[1] == len(prompts[0]) + 1 + from_prefill
        assert max(batch_rows) == 3 and batch_rows[-1] == 0 and kv[-1] == 0
        assert sum(joined) == 4  # each request's row, once
        # each prompt but its last token (the first decode step's input) or all of it,
        # padding included
        assert sum(prefilled) >= sum(len(p) - 1 + from_prefill for p in prompts[:4])
    if decode is not None:  # one row, then three (2 and 1 as they end): 3 is new, once
        assert known == {1, 2} and decode.row_counts == {1, 2, 3} and sum(shapes) == 1
    else:
        assert set(shapes) == {0}


def _step(
    t: float,
    ms: float,
    inserted: int = 0,
    rows: int = 4,
    masked: int = 0,
    shapes: int = 0,
    backend: float | None = None,
    ahead: int = 0,
    prefilled: int = 0,
    joined: int = 0,
    cpu: float | None = None,
    switched: tuple[int, int] = (1, 0),
    settle: float | None = None,
) -> list[float | None]:
    backend = ms - 1 if backend is None else backend
    inserting = 0.5 if inserted else 0.0
    batch, kv = rows + 1, 100 * rows
    cpu = ms / 2 if cpu is None else cpu
    return [
        *(t, ms, backend, inserted, inserting, rows, rows, masked, shapes, ms / 2, ahead),
        *(batch, kv, prefilled, joined, cpu, *switched, 64.0, settle),
    ]


def test_summary_splits_the_wall_time() -> None:
    # 0-10 ms a step with a join, 12-17 a plain one, 17-22 a last one; its rows left at 22
    # and nothing ran until 40
    steps = [_step(0.0, 10, 2), _step(0.012, 5), _step(0.017, 5, rows=0)]
    s = summarize(steps, 0.0, 0.040)
    assert s is not None
    assert s["steps"] == 3 and s["wall_s"] == 0.04
    assert s["step"] == pytest.approx(20 / 40)
    assert s["backend"] == pytest.approx(17 / 40)
    assert s["between"] == pytest.approx(2 / 40)  # 10-12: rows waited for their step
    assert s["empty"] == pytest.approx(18 / 40)
    assert (s["plain_step_ms"], s["join_step_ms"], s["insert_ms"]) == (5, 10, 0.5)
    assert s["joins_per_100"] == pytest.approx(33.3) and s["joiners"] == 2
    assert s["plain_wait_ms"] == 2.5  # the plain steps' (5 ms: 2.5 each)
    assert s["leaving"] == pytest.approx(1 / 40)  # the last step: 4 rows, then 0


def test_leaving_is_the_time_outside_the_backend_where_rows_left() -> None:
    steps = [
        _step(0.0, 10, 4, rows=4),  # 4 start
        _step(0.01, 20, rows=2, backend=5),  # 2 left: 15 ms outside the backend
        _step(0.03, 20, 1, rows=3, backend=5),  # 1 started, none left
        _step(0.05, 10, 2, rows=4, backend=2),  # 2 started, 1 left: 8 ms
    ]
    s = summarize(steps, 0.0, 0.1)
    assert s is not None and s["leaving"] == pytest.approx(23 / 100)
    assert s["settle"] == 0 and s["settle_ms"] is None
    # the same rows leaving at the settles after their steps' outputs went out
    steps[1][-1], steps[3][-1], steps[2][-1] = 4.0, 2.0, 0.0
    s = summarize(steps, 0.0, 0.1)
    assert s is not None and s["leaving"] == pytest.approx(29 / 100)
    assert s["settle"] == pytest.approx(6 / 100) and s["settle_ms"] == 3
    assert s["step"] == pytest.approx(66 / 100)  # the steps' 60 ms and their settles'


def test_summary_splits_plain_steps_by_mask_and_counts_new_shapes() -> None:
    steps = [
        _step(0.0, 10, 2, shapes=1),
        _step(0.01, 6, masked=1),
        _step(0.02, 8, masked=1),
        _step(0.03, 4),
        _step(0.04, 9, masked=1, shapes=1),
        _step(0.05, 1, masked=None, ahead=1),  # only read tokens: not a plain step
        _step(0.06, 30, masked=1, prefilled=256),  # ran a prompt: not a plain step
        _step(0.09, 20, masked=1, joined=2),  # rows joined: not a plain step
    ]
    s = summarize(steps)
    assert s is not None
    assert (s["plain_masked_ms"], s["plain_unmasked_ms"]) == (8, 4)
    assert s["masked_share"] == 0.75
    assert s["prefill_steps_per_100"] == pytest.approx(100 / 8) and s["prefill_step_ms"] == 30
    assert s["prefill_positions"] == 256
    assert (s["new_shape_steps"], s["new_shape_step_ms"]) == (2, 9.5)
    assert s["read_aheads"] == 1 and s["plain_step_ms"] == 7
    assert (s["plain_batch_rows"], s["plain_kv_size"]) == (5, 400)  # of the plain steps
    assert (s["plain_cpu_ms"], s["plain_off_cpu_ms"]) == (3.5, 3.5)  # half of each
    assert (s["plain_voluntary_per_100"], s["plain_involuntary_per_100"]) == (100, 0)
    assert s["cache_mb"] == 64
    old = summarize([x[:7] for x in steps])  # a trace of an older worker: no such fields
    assert old is not None and old["plain_masked_ms"] is None and old["new_shape_steps"] == 0
    assert old["plain_wait_ms"] is None and old["plain_kv_size"] is None
    assert old["plain_cpu_ms"] is None and old["plain_involuntary_per_100"] is None
    assert old["cache_mb"] is None


def test_a_step_off_the_cpu_and_preempted_shows_in_the_summary() -> None:
    """Two plain steps of 6 ms: one on the CPU all along, one 4 ms off it and preempted
    twice (the shape of a host that is slow because its thread is not running)."""
    steps = [_step(0.0, 6, cpu=6, switched=(0, 0)), _step(0.01, 6, cpu=2, switched=(1, 2))]
    s = summarize(steps)
    assert s is not None
    assert (s["plain_cpu_ms"], s["plain_off_cpu_ms"]) == (4, 2)
    assert (s["plain_voluntary_per_100"], s["plain_involuntary_per_100"]) == (50, 100)


def test_levels_take_the_steps_inside_their_windows(tmp_path: Path) -> None:
    lines = [_step(1.0, 4), _step(1.01, 4, 1), _step(5.0, 8)]
    (tmp_path / "steps-7.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    run = {"concurrency": 4, "window": [0.5, 2.0]}
    serving = {"models": {"m": {"targets": {"gateway": {"levels": [{**run, "runs": [run]}]}}}}}
    [line] = per_level(read_traces(tmp_path), serving)
    assert (line["source"], line["concurrency"], line["steps"]) == ("gateway", 4, 2)
    assert line["joins_per_100"] == 50.0


def test_an_early_first_token_is_not_a_read_ahead(
    chat: Loaded, prompts: list[list[int]], tmp_path: Path
) -> None:
    """engine.first_token_read = "early": the step that prefilled a lone request sends its
    first token (a step with a forward pass, not a read-ahead), the next sends nothing."""
    engine = chat.engine(batcher="rows", first_token="prefill", first_token_read="early")
    assert engine.backend.batch.early_first
    traced = StepTrace.wrap(engine, {STEP_TRACE_ENV: str(tmp_path / "trace")})
    out = drive(traced, [greedy("a", prompts[0], 6, ignore_eos=True)])
    assert token_ids(out["a"]) == reference_greedy(chat.model, prompts[0], 6)
    [trace] = read_traces(tmp_path / "trace").values()
    first, second = trace[0], trace[1]
    assert (first[3], first[6], first[10], first[13]) == (1, 1, 0, len(prompts[0]))
    assert (second[6], second[10], second[13]) == (0, 0, 0)


def test_starts_list_each_starting_step_with_the_idle_spell_before_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a turn starts at 0 (no step before), ends at 30 with a 2 ms settle; the next starts
    # at 50 after a plain step at 20-30 (a second request starting beside it counts once)
    steps = [
        _step(0.0, 12, 1, prefilled=256, cpu=11.5),
        _step(0.02, 8, settle=2.0),
        _step(0.05, 15, 2, prefilled=192, cpu=14.0),
        _step(0.07, 4),
    ]
    first, second = starts(steps)
    assert first["idle_ms"] is None and second["idle_ms"] == pytest.approx(20.0)
    assert (first["step_ms"], first["cpu_ms"], first["prefilled"]) == (12, 11.5, 256)
    assert (second["started"], second["backend_ms"], second["insert_ms"]) == (2, 14, 0.5)
    assert second["kv_size"] == 400 and second["t"] == 0.05
    assert starts([x[:7] for x in steps])[1]["cpu_ms"] is None  # an older worker's trace
    (tmp_path / "steps-9.jsonl").write_text("".join(json.dumps(x) + "\n" for x in steps))
    assert step_trace.main([str(tmp_path), "--starts"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    with pytest.raises(SystemExit):  # one or the other
        step_trace.main([str(tmp_path), "--starts", "--serving", str(tmp_path / "s.json")])
    assert [(x["file"], x["prefilled"]) for x in lines] == [
        ("steps-9.jsonl", 256),
        ("steps-9.jsonl", 192),
    ]


def test_steps_before_an_abort_that_empties_the_engine_are_written(
    chat: Loaded, prompts: list[list[int]], tmp_path: Path
) -> None:
    engine = StepTrace.wrap(chat.engine(), {STEP_TRACE_ENV: str(tmp_path)})
    engine.add(greedy("a", prompts[0], 50, ignore_eos=True))
    engine.step()
    engine.step()
    assert not read_traces(tmp_path) or not next(iter(read_traces(tmp_path).values()))
    engine.abort(["a"])  # no step follows: a drain, or the last client gone
    [trace] = read_traces(tmp_path).values()
    assert len(trace) == 2


def test_lines_written_before_the_engine_is_idle_keep_their_settle(
    chat: Loaded, prompts: list[list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lines flushed every few steps (FLUSH_EVERY) as the whole trace at the end: a line
    leaves only once its settle is in it."""
    settles = []
    for every, folder in ((10**6, tmp_path / "once"), (2, tmp_path / "often")):
        monkeypatch.setattr(steptrace, "FLUSH_EVERY", every)
        engine = StepTrace.wrap(chat.engine(), {STEP_TRACE_ENV: str(folder)})
        drive(
            engine, [greedy(f"r{i}", p, 3 + i, ignore_eos=True) for i, p in enumerate(prompts[:3])]
        )
        [trace] = read_traces(folder).values()
        settles.append([line[-1] is None for line in trace])
    assert settles[0] == settles[1] and False in settles[0]


def test_a_folder_it_cannot_write_leaves_the_engine_alone(
    chat: Loaded, prompts: list[list[int]], tmp_path: Path
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    engine = chat.engine()
    assert StepTrace.wrap(engine, {STEP_TRACE_ENV: str(blocker / "trace")}) is engine
    traced = StepTrace.wrap(chat.engine(), {STEP_TRACE_ENV: str(tmp_path / "t")})
    (tmp_path / "t").rmdir()
    (tmp_path / "t").write_text("now a file: every write fails")
    out = drive(traced, [greedy("a", prompts[0], 4, ignore_eos=True)])  # steps go on
    assert token_ids(out["a"]) == reference_greedy(chat.model, prompts[0], 4)
