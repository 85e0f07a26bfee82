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

log = logging.getLogger("gateway.workers.supervisor")


def save_pids(path: Path, pids: Iterable[int]) -> None:
    path.write_text(json.dumps(list(pids)))


def reap_leftovers(path: Path) -> None:
    """Kill the listed pids that are still worker processes. A missing or corrupt file is
    nothing to reap: it must never stop a gateway from starting."""
    try:
        pids = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if not isinstance(pids, list):
        log.warning("ignoring %s: not a list of pids", path)
        return
    for pid in pids:
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            continue
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            if "worker" in proc.cmdline() and proc.pid != os.getpid():
                log.warning("killing leftover worker pid %d", pid)
                proc.kill()
