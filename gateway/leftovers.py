"""Workers left behind by a gateway that crashed: their pids are kept in the run dir, and
the next gateway kills any of them still alive before it spawns its own."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

import psutil

log = logging.getLogger("gateway.supervisor")


def save_pids(path: Path, pids: Iterable[int]) -> None:
    path.write_text(json.dumps(list(pids)))


def reap_leftovers(path: Path) -> None:
    try:
        pids = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    for pid in pids:
        with contextlib.suppress(psutil.Error, TypeError, ValueError):
            proc = psutil.Process(int(pid))
            if "worker" in proc.cmdline() and proc.pid != os.getpid():
                log.warning("killing leftover worker pid %d", pid)
                proc.kill()
