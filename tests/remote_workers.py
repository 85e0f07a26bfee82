"""Workers on "other machines" for end-to-end tests: `gatewayctl worker` processes, each
with its own config and key pair, dialing a test gateway's worker port over TCP loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

from shared.cluster import ALLOWED_FILE, GATEWAY_KEY, WORKER_KEY, AllowedWorkers, key_pair
from tests.gateway_proc import GatewayProc, write_config


class RemoteWorker:
    def __init__(
        self,
        gw: GatewayProc,
        name: str,
        model: dict[str, Any],
        allow: bool = True,
        once: bool = True,
        env: dict[str, str] | None = None,
        gateway_key: str | None = None,
        address: str | None = None,  # where it dials (default: the gateway's worker port)
        by_ctl: bool = False,  # allowed by `gatewayctl workers add`, with `workers key`'s key
    ) -> None:
        self.name = name
        self.home = gw.run_dir / f"host-{name}"
        self.home.mkdir(exist_ok=True)
        self.config = write_config(
            self.home / "config.toml",
            [dict(model)],
            {"cluster_dir": str(self.home / "cluster"), "log_level": "info"},
        )
        # its key pair, made where `gatewayctl worker` finds it (as its --show-key would, in
        # most of a second: tests/test_e2e_remote.py runs that once)
        self.public_key = key_pair(self.home / "cluster" / WORKER_KEY).public
        if allow and by_ctl:
            gw.ctl("workers", "add", name, self.public_key)
        elif allow:  # as `gatewayctl workers add` does, without a Python start
            AllowedWorkers(gw.run_dir / "cluster" / ALLOWED_FILE).add(name, self.public_key)
        if gateway_key is None:
            gateway_key = gw.ctl("workers", "key").stdout.strip() if by_ctl else workers_key(gw)
        where = address or gw.workers_address
        args = ["--gateway", where, "--gateway-key", gateway_key, "--model", model["name"]]
        args += ["--id", f"{model['name']}@{name}"]
        self.log = open(self.home / "worker.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [*self._cmd(), "worker", *args, *(["--once"] if once else [])],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )

    def _cmd(self) -> list[str]:
        return [sys.executable, "-m", "gateway", "--config", str(self.config)]

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self._cmd(), *args], capture_output=True, text=True, timeout=60, check=True
        )

    def logs(self) -> str:
        return (self.home / "worker.log").read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


def workers_key(gw: GatewayProc) -> str:
    """The key workers check `gw` by, as `gatewayctl workers key` prints it there."""
    return key_pair(gw.run_dir / "cluster" / GATEWAY_KEY, create=False).public


def replicas(gw: GatewayProc, model: str) -> dict[str, dict[str, Any]]:
    """The model's workers in `ps`, by worker id."""
    return {r["worker_id"]: r for r in gw.ps()[model]["replicas"]}


def kill9(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
