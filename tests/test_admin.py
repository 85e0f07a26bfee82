"""gatewayctl ps: the admin API's rows (a fake supervisor over real slots, fake heartbeats)
and the table gatewayctl draws from them."""

from __future__ import annotations

import time

from litestar.datastructures import State
from litestar.testing import TestClient

from gateway.admin import create_admin_app
from gateway.ctl.ps import plain, prefix_cache
from gateway.workers.slots import Slot, status_row
from tests.slot_fakes import STATS, GiB, heartbeat, ready_slot


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
    }
    assert off["prefix_cache"] is None  # the worker reports none (prefix_cache = false)
    assert gone["prefix_cache"] is None and gone["state"] == "unloaded"


def test_prefix_cache_cell() -> None:
    stats = {"nbytes": int(1.2 * GiB), "capacity_bytes": 2 * GiB, "lookups": 40, "hits": 26}
    assert prefix_cache(stats) == "1.2/2.0 GiB 65% hit"
    small = {"nbytes": 300 * 2**20, "capacity_bytes": 512 * 2**20, "lookups": 0, "hits": 0}
    assert prefix_cache(small) == "300.0/512.0 MiB"  # nothing looked up yet: no rate
    assert prefix_cache(None) == "-"  # no worker, or no prefix cache


def test_table_has_a_prefix_cache_column() -> None:
    rows = ps_rows(ready_slot("chat", heartbeat(STATS)), ready_slot("off", heartbeat()))
    header, chat, off = plain(rows).splitlines()
    assert header.split()[-2:] == ["PREFIX", "CACHE"]
    assert chat.endswith("1.2/2.0 GiB 62% hit")
    assert off.endswith("  -")
    # rows from a gateway that predates the column
    old = {k: v for k, v in rows[0].items() if k != "prefix_cache"}
    assert plain([old]).splitlines()[1].endswith("  -")
