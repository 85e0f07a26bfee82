"""Driving a service manager (launchctl, systemctl): the commands' runner, their errors, what
a manager reports."""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.ctl.service.spec import (
    ServiceError,
)

# ---- launchctl / systemctl -------------------------------------------------------------

Run = Callable[[Sequence[str]], subprocess.CompletedProcess[str]]


def run_tool(argv: Sequence[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise ToolMissing(f"{argv[0]}: not available (not found on PATH)") from None
    except subprocess.TimeoutExpired:
        raise ServiceError(f"{shlex.join(argv)}: no answer after {timeout:.0f} s") from None


class ToolMissing(ServiceError):
    pass


@dataclass(slots=True)
class ManagerState:
    loaded: bool
    running: bool
    state: str
    pid: int | None = None
    last_exit: int | None = None


class Manager(Protocol):
    def start(self, replaced: bool) -> None: ...
    def stop(self) -> None: ...
    def forget(self) -> None: ...
    def restart(self) -> None: ...
    def query(self) -> ManagerState: ...


def check(argv: list[str], run: Run) -> subprocess.CompletedProcess[str]:
    return raise_for(argv, run(argv))


def raise_for(
    argv: list[str], done: subprocess.CompletedProcess[str]
) -> subprocess.CompletedProcess[str]:
    if done.returncode != 0:
        reason = (done.stderr or done.stdout).strip().replace("\n", "; ")
        if "Failed to connect to bus" in reason:
            reason += " (no systemd user session?)"
        raise ServiceError(f"{shlex.join(argv)}: {reason or f'exit status {done.returncode}'}")
    return done


def parse_int(text: str | None) -> int | None:
    return int(text) if text and re.fullmatch(r"-?\d+", text.strip()) else None
