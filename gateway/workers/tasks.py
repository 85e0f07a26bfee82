"""Background tasks the supervisor starts and must end: watches, restarts, drains."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class Tasks:
    """Fire-and-forget coroutines, kept referenced until done and cancelled together."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def cancel_all(self) -> None:
        for task in list(self._tasks):
            task.cancel()
