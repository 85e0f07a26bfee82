"""GuideThread: a step's tokens taken from the device on the thread, each guided row's token
consumed, and the masks of the rows whose guide forbids something, packed for the device."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from shared.types import OutputFormat, ResponseFormat
from worker.structured.ahead import GuideThread
from worker.structured.grammars import response_grammar
from worker.structured.guide import Grammars, Guide, Masks

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@dataclass
class Row:
    uid: int
    guide: Guide | None
    dead: bool = False


@pytest.fixture(scope="module")
def grammars(hermes_model_dir: Path) -> Grammars:
    return Grammars(load_tokenizer(hermes_model_dir))


def guide(grammars: Grammars) -> Guide:
    text = response_grammar(ResponseFormat(OutputFormat.JSON_SCHEMA, SCHEMA, strict=True))
    assert text is not None
    return Guide(grammars.matcher(text), words=grammars.words)


def test_the_thread_takes_the_tokens_and_masks_the_guided_rows(grammars: Grammars) -> None:
    brace = grammars.hf.encode("{", add_special_tokens=False)[0]
    rows = [Row(0, None), Row(1, guide(grammars)), Row(2, None), Row(3, guide(grammars), True)]
    probe = mx.array([7, brace, 9, brace])
    mx.async_eval(probe)
    thread = GuideThread(Masks())
    ahead = thread.submit(probe, rows, version=5)
    masked = ahead.future.result(timeout=30)
    assert ahead.rows is rows and ahead.version == 5
    assert masked.tokens == [7, brace, 9, brace]
    assert masked.at == [1]  # the dead row is left alone
    assert rows[3].guide is not None and rows[1].guide is not None
    twin = guide(grammars)
    twin.consume(brace)
    want = twin.bitmask(1)
    assert twin.fill(want, 0)
    assert np.array_equal(masked.bitmask, want)
    assert masked.packed is not None and masked.packed.lead == 1  # row indices first
    data = np.array(masked.packed.data)
    assert data[0] == 1 and np.array_equal(data[1:], want.reshape(-1))
    # what the engine reads is settled by the batch, not by the thread
    assert not rows[1].guide.done and rows[1].guide.failure is None


def test_nothing_guided_masks_nothing(grammars: Grammars) -> None:
    probe = mx.array([1, 2])
    mx.async_eval(probe)
    masked = GuideThread(Masks()).submit(probe, [Row(0, None), Row(1, None)], 0).future.result(30)
    assert masked.tokens == [1, 2] and masked.at == [] and masked.packed is None
