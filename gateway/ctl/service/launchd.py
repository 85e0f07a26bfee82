"""macOS: the LaunchAgent / LaunchDaemon plist, and launchctl."""

from __future__ import annotations

import re
from typing import Any

from gateway.ctl.service.manager import (
    ManagerState,
    Run,
    check,
    parse_int,
    raise_for,
)
from gateway.ctl.service.spec import (
    LABEL,
    MAX_OPEN_FILES,
    RESTART_DELAY_S,
    ServiceError,
    ServiceSpec,
)


def launchd_plist(spec: ServiceSpec) -> dict[str, Any]:
    plist: dict[str, Any] = {
        "Label": LABEL,
        "ProgramArguments": spec.argv,
        "RunAtLoad": True,
        # Restart after a crash (non-zero exit, or death by a signal), not after a clean
        # exit: `true` would respawn a gateway that was stopped on purpose. Same as
        # systemd's Restart=on-failure.
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": RESTART_DELAY_S,
        # Interactive: exempt from App Nap and background QoS throttling, which would add
        # latency to every token of a server that is mostly idle between requests.
        "ProcessType": "Interactive",
        # launchd sends SIGTERM, waits this long for the drain, then SIGKILLs the job.
        "ExitTimeOut": spec.stop_timeout_s,
        "WorkingDirectory": spec.working_dir,
        "EnvironmentVariables": spec.environment,
        "StandardOutPath": spec.log_file,
        "StandardErrorPath": spec.log_file,
        "SoftResourceLimits": {"NumberOfFiles": MAX_OPEN_FILES},
    }
    if spec.user:
        plist["UserName"] = spec.user
    return plist


class Launchd:
    def __init__(self, spec: ServiceSpec, run: Run) -> None:
        self.spec, self.run = spec, run
        self.domain = "system" if spec.system else f"gui/{spec.uid}"
        self.target = f"{self.domain}/{LABEL}"

    def start(self, replaced: bool) -> None:
        if self.query().loaded:
            if not replaced:
                check(["launchctl", "kickstart", self.target], self.run)  # no-op if running
                return
            check(["launchctl", "bootout", self.target], self.run)
        check(["launchctl", "enable", self.target], self.run)  # undo a `launchctl disable`
        check(["launchctl", "bootstrap", self.domain, str(self.spec.path)], self.run)

    def stop(self) -> None:
        if self.query().loaded:
            check(["launchctl", "bootout", self.target], self.run)

    def forget(self) -> None:
        pass

    def restart(self) -> None:
        if not self.query().loaded:
            raise ServiceError(f"{self.target} is not loaded: `gatewayctl service install`")
        check(["launchctl", "kickstart", "-k", self.target], self.run)

    def query(self) -> ManagerState:
        argv = ["launchctl", "print", self.target]
        done = self.run(argv)
        if done.returncode != 0 and "Could not find service" in done.stdout + done.stderr:
            return ManagerState(loaded=False, running=False, state="not loaded")
        raise_for(argv, done)
        fields = dict(re.findall(r"^\t([a-z][a-z ]*) = (.*)$", done.stdout, re.MULTILINE))
        state = fields.get("state", "unknown")
        return ManagerState(
            loaded=True,
            running=state == "running",
            state=state,
            pid=parse_int(fields.get("pid")),
            last_exit=parse_int(fields.get("last exit code")),
        )
