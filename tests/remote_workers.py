"""Workers on "other machines" for end-to-end tests: `gatewayctl worker` processes, each
with its own config and key pair, dialing a test gateway's worker port over TCP loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

from shared.cluster import WORKER_KEY, key_pair
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
        if allow:
            gw.ctl("workers", "add", name, self.public_key)
        key = gateway_key or gw.workers_key()
        where = address or gw.workers_address
        args = ["--gateway", where, "--gateway-key", key, "--model", model["name"]]
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


def replicas(gw: GatewayProc, model: str) -> dict[str, dict[str, Any]]:
    """The model's workers in `ps`, by worker id."""
    return {r["worker_id"]: r for r in gw.ps()[model]["replicas"]}


def kill9(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
