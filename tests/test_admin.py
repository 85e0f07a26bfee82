"""gatewayctl ps: the admin API's rows (a fake supervisor over real slots, fake heartbeats)
and the table gatewayctl draws from them."""

from __future__ import annotations

import time

from litestar.datastructures import State
from litestar.testing import TestClient

from gateway.admin import create_admin_app
from gateway.ctl.ps import plain, prefix_cache, prompt_segments
from gateway.workers.slots import Slot, status_row
from tests.slot_fakes import SEGMENTS, STATS, GiB, heartbeat, ready_slot


class FakeSupervisor:
    def __init__(self, *slots: Slot) -> None:
        self.slots = {slot.name: slot for slot in slots}

    def ps(self) -> list[dict[str, object]]:
        now = time.monotonic()
        return [status_row(slot, -1.0, now) for slot in self.slots.values()]


def ps_rows(*slots: Slot) -> list[dict[str, object]]:
    app = create_admin_app(State({"supervisor": FakeSupervisor(*slots)}))
    with TestClient(app) as client:
        r = client.get("/ps")
    assert r.status_code == 200
    rows: list[dict[str, object]] = r.json()
    return rows


def test_ps_rows_carry_theprefix_cache() -> None:
    unloaded = ready_slot("gone", heartbeat(STATS))
    unloaded.handle = None
    rows = ps_rows(ready_slot("chat", heartbeat(STATS)), ready_slot("off", heartbeat()), unloaded)
    chat, off, gone = rows
    assert chat["state"] == "ready" and chat["running"] == 1
    assert chat["prefix_cache"] == {
        "entries": 12,
        "nbytes": int(1.2 * GiB),
        "capacity_bytes": 2 * GiB,
        "lookups": 40,
        "hits": 25,
        "hit_tokens": 9000,
        "evictions": 3,
        "oversize": 2,
    }
    assert off["prefix_cache"] is None  # the worker reports none (prefix_cache = false)
    assert gone["prefix_cache"] is None and gone["state"] == "unloaded"


def test_ps_rows_carry_the_prompt_segment_memo() -> None:
    unloaded = ready_slot("gone", heartbeat(prompt_segments=SEGMENTS))
    unloaded.handle = None
    on = ready_slot("chat", heartbeat(STATS, SEGMENTS))
    chat, off, gone = ps_rows(on, ready_slot("off", heartbeat(STATS)), unloaded)
    assert chat["prompt_segments"] == {
        "entries": 30,
        "nbytes": 3_250_000,
        "capacity_bytes": 32 * 2**20,
        "prompts": 9,
        "hits": 46,
        "misses": 4,
        "evictions": 2,
    }
    assert off["prompt_segments"] is None  # segments off (or a model without them)
    assert gone["prompt_segments"] is None


def test_prefix_cache_cell() -> None:
    stats = {"nbytes": int(1.2 * GiB), "capacity_bytes": 2 * GiB, "lookups": 40, "hits": 26}
    assert prefix_cache(stats) == "1.2/2.0 GiB 65% hit"
    small = {"nbytes": 300 * 2**20, "capacity_bytes": 512 * 2**20, "lookups": 0, "hits": 0}
    assert prefix_cache(small) == "300.0/512.0 MiB"  # nothing looked up yet: no rate
    assert prefix_cache(None) == "-"  # no worker, or no prefix cache


def test_prompt_memo_cell() -> None:
    stats = {"nbytes": 3_250_000, "capacity_bytes": 32 * 2**20, "hits": 46, "misses": 4}
    assert prompt_segments(stats) == "3.1/32.0 MiB 92% hit"
    small = {"nbytes": 120 * 2**10, "capacity_bytes": 512 * 2**10, "hits": 0, "misses": 0}
    assert prompt_segments(small) == "120.0/512.0 KiB"  # nothing looked up yet: no rate
    assert prompt_segments(None) == "-"  # no worker, or segments off


def test_table_has_prefix_cache_and_prompt_memo_columns() -> None:
    rows = ps_rows(ready_slot("chat", heartbeat(STATS, SEGMENTS)), ready_slot("off", heartbeat()))
    header, chat, off, note = plain(rows).splitlines()
    assert header.split()[-4:] == ["PREFIX", "CACHE", "PROMPT", "MEMO"]
    assert chat.endswith("1.2/2.0 GiB 62% hit  3.1/32.0 MiB 92% hit")
    assert off.split()[-2:] == ["-", "-"]
    assert note == (  # STATS: two requests' KV larger than the bound
        "chat: 2 request(s) had more KV than its prefix cache's bound and were not kept "
        "(engine.prefix_cache_gb)"
    )
    # rows from a gateway that predates the columns
    old = {k: v for k, v in rows[0].items() if k not in ("prefix_cache", "prompt_segments")}
    assert plain([old]).splitlines()[1].split()[-2:] == ["-", "-"]
