"""worker/link.py: a remote worker's view of its link. A drop counts once the worker has
joined; one join answers every drop of one outage (it waits until every connection is back);
a second join waits a second; sessions count up and number their refusals from 1."""

from __future__ import annotations

import zmq

from worker.link import REJOIN_COALESCE_S, Joins, LinkWatch


class _Silent:
    """A monitor socket that never speaks (the test calls the watch's handler itself)."""

    def poll(self, timeout: int = 0) -> int:
        return 0


def watch() -> LinkWatch:
    silent = _Silent()
    return LinkWatch(silent, "tcp://gw:1", "KEY", (silent, silent))  # type: ignore[arg-type]


def test_drops_before_the_first_handshake_do_not_count() -> None:
    link = watch()
    link._on(1, zmq.EVENT_DISCONNECTED)
    assert not link.dropped.is_set()
    link._on(0, zmq.EVENT_HANDSHAKE_SUCCEEDED)  # the requests socket: joined
    link._on(1, zmq.EVENT_HANDSHAKE_SUCCEEDED)
    assert link.connected.is_set() and link.whole and not link.dropped.is_set()


def test_an_outage_is_whole_again_only_when_every_connection_is_back() -> None:
    link = watch()
    link._on(0, zmq.EVENT_HANDSHAKE_SUCCEEDED)
    for index in (2, 0):  # two of its three connections drop
        link._on(index, zmq.EVENT_DISCONNECTED)
    assert link.dropped.is_set() and not link.whole
    link._on(2, zmq.EVENT_HANDSHAKE_SUCCEEDED)
    assert not link.whole  # the requests socket is not back yet
    link._on(0, zmq.EVENT_HANDSHAKE_SUCCEEDED)
    assert link.whole and link.dropped.is_set()  # now the worker joins again, once
    # the output sockets' monitors say nothing else; an unknown event there is ignored
    link._on(1, zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def test_sessions_count_up_and_a_second_join_waits() -> None:
    joins = Joins()
    assert joins.said == 0 and joins.due()
    joins.seq = 3  # refusals numbered in session 0
    assert joins.again("a drop") == 1 and joins.seq == 0
    assert not joins.due() and joins.again("the same drop, seen twice") is None
    joins._at -= REJOIN_COALESCE_S  # a second later
    assert joins.due() and joins.again("another drop") == 2


def test_a_join_the_gateway_asked_for_answers_the_drops_before_it() -> None:
    """Every connection dropped; the gateway's Rejoin made the worker join before its own
    check did (once every connection is back): that join answers the outage, and no second
    join follows (it would end the requests the new session had started)."""
    link = watch()
    link._on(0, zmq.EVENT_HANDSHAKE_SUCCEEDED)
    for index in (0, 1, 2):
        link._on(index, zmq.EVENT_DISCONNECTED)
    link._on(0, zmq.EVENT_HANDSHAKE_SUCCEEDED)
    link.joining()  # asked to rejoin while the output connections are still down
    for index in (1, 2):
        link._on(index, zmq.EVENT_HANDSHAKE_SUCCEEDED)
    assert link.whole and not link.dropped.is_set()  # no second join
    link._on(2, zmq.EVENT_DISCONNECTED)  # a later drop counts again
    assert link.dropped.is_set()
