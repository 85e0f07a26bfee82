"""Linux: the systemd unit, and systemctl."""

from __future__ import annotations

import re
import subprocess

from gateway.ctl.service.manager import (
    ManagerState,
    Run,
    check,
    parse_int,
)
from gateway.ctl.service.spec import (
    MAX_OPEN_FILES,
    RESTART_DELAY_S,
    UNIT,
    ServiceError,
    ServiceSpec,
)


def systemd_unit(spec: ServiceSpec) -> str:
    values = [*spec.argv, *spec.environment.values(), spec.working_dir]
    if any("\n" in v for v in values):
        raise ServiceError("a path or environment value contains a newline", code=2)
    lines = [
        "# mlx-gateway; see docs/operations.md, Running as a service.",
        "[Unit]",
        "Description=mlx-gateway: local LLM serving on MLX",
        *(["After=network.target"] if spec.system else []),
        "",
        "[Service]",
        "Type=simple",
        "ExecStart=" + " ".join(_sd_quote(a.replace("$", "$$")) for a in spec.argv),
        f"WorkingDirectory={spec.working_dir.replace('%', '%%')}",
        *(f"Environment={_sd_quote(f'{k}={v}', always=True)}" for k, v in spec.environment.items()),
        *([f"User={spec.user}"] if spec.user else []),
        *(
            ["RuntimeDirectory=mlx-gateway", "RuntimeDirectoryMode=0700"]
            if spec.runtime_dir
            else []
        ),
        "Restart=on-failure",
        f"RestartSec={RESTART_DELAY_S}",
        # SIGTERM to the gateway alone: it drains its workers itself; whatever is left
        # after TimeoutStopSec is SIGKILLed, workers included.
        "KillSignal=SIGTERM",
        "KillMode=mixed",
        f"TimeoutStopSec={spec.stop_timeout_s}",
        f"LimitNOFILE={MAX_OPEN_FILES}",
        "",
        "[Install]",
        f"WantedBy={'multi-user.target' if spec.system else 'default.target'}",
    ]
    return "\n".join(lines) + "\n"


def _sd_quote(value: str, *, always: bool = False) -> str:
    """One word of a systemd setting: `%` is a specifier, quotes take C-style escapes."""
    value = value.replace("%", "%%")
    if not always and re.fullmatch(r"[\w@%+=:,./-]+", value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


class Systemd:
    def __init__(self, spec: ServiceSpec, run: Run) -> None:
        self.run = run
        self.systemctl = ["systemctl"] if spec.system else ["systemctl", "--user"]

    def _do(self, *args: str) -> subprocess.CompletedProcess[str]:
        return check([*self.systemctl, *args], self.run)

    def start(self, replaced: bool) -> None:
        self._do("daemon-reload")
        self._do("enable", "--now", UNIT)
        if replaced:
            self._do("try-restart", UNIT)  # a running one picks up the new file

    def stop(self) -> None:
        self._do("disable", "--now", UNIT)

    def forget(self) -> None:
        self._do("daemon-reload")

    def restart(self) -> None:
        self._do("restart", UNIT)

    def query(self) -> ManagerState:
        keys = "LoadState,UnitFileState,ActiveState,SubState,MainPID,ExecMainStatus"
        done = self._do("show", "-p", keys, UNIT)
        props = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
        active = props.get("ActiveState", "unknown")
        enabled = props.get("UnitFileState") or "-"
        return ManagerState(
            loaded=props.get("LoadState") == "loaded",
            running=active in ("active", "reloading"),
            state=f"{active} ({props.get('SubState', '?')}), {enabled}",
            pid=parse_int(props.get("MainPID")) or None,
            last_exit=parse_int(props.get("ExecMainStatus")),
        )
