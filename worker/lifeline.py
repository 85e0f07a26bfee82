"""A worker process ends with what started it. macOS has no PDEATHSIG, so a thread watches:
the parent changing (it died: the process was re-parented) ends this one; and a rank 0 under
mpirun, whose parent is mpirun, also ends when the gateway named in MLX_GATEWAY_PID is gone
(mpirun then ends the other ranks: rank 0's exit status is not 0)."""

from __future__ import annotations

import logging
import os
import threading

import psutil

from shared.sharding import GATEWAY_PID_ENV

log = logging.getLogger("worker")

GONE_EXIT = 3  # the status of a worker whose gateway went


def _alive(pid: int) -> bool:
    """Running: a zombie (exited, not yet reaped by its parent) is gone."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True  # someone's we may not look at: it exists


def gone(parent: int, gateway: int | None) -> str | None:
    """What is gone of what this process lives for, or None."""
    if os.getppid() != parent:
        return "its parent"
    if gateway is not None and not _alive(gateway):
        return "the gateway"
    return None


def watch(stopping: threading.Event, every: float) -> threading.Thread:
    """Start the watch: this process exits (GONE_EXIT) once gone() says so, until
    `stopping` is set."""
    parent = os.getppid()
    named = os.environ.get(GATEWAY_PID_ENV)
    gateway = int(named) if named else None

    def run() -> None:
        while not stopping.wait(every):
            what = gone(parent, gateway)
            if what is not None:
                log.error("%s is gone; exiting", what)
                os._exit(GONE_EXIT)

    thread = threading.Thread(target=run, name="parent-watch", daemon=True)
    thread.start()
    return thread
