"""Run a real gateway (and its real worker processes) for end-to-end tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai

READY_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(value)


def write_config(path: Path, models: list[dict[str, Any]], server: dict[str, Any]) -> Path:
    lines = ["[server]"] + [f"{k} = {toml_value(v)}" for k, v in server.items()]
    for model in models:
        engine = model.pop("engine", {})
        lines += ["", "[[models]]"] + [f"{k} = {toml_value(v)}" for k, v in model.items()]
        if engine:
            lines += ["[models.engine]"] + [f"{k} = {toml_value(v)}" for k, v in engine.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


class GatewayProc:
    def __init__(
        self, models: list[dict[str, Any]], env: dict[str, str] | None = None, **server: Any
    ) -> None:
        # Short run dir: ipc socket paths must stay under 104 bytes.
        given = server.get("run_dir")
        self.run_dir = Path(given) if given else Path(tempfile.mkdtemp(prefix="gw", dir="/tmp"))
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        # Keys live in the run dir: a developer's own key file never turns auth on here.
        keys = str(self.run_dir / "keys.json")
        # A short drain at SIGTERM: tests often end with endless streams still open.
        server = {
            "port": self.port,
            "run_dir": str(self.run_dir),
            "keys_file": keys,
            "cluster_dir": str(self.run_dir / "cluster"),  # nor its worker keys
            "drain_timeout_s": 3.0,
            **server,
        }
        self.workers_address: str = server.get("workers_listen") or ""
        self.preloaded = [m["name"] for m in models if m.get("preload", True)]
        self.config = write_config(self.run_dir / "config.toml", models, server)
        self.log = open(self.run_dir / "gateway.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway", "--config", str(self.config), "serve"],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )

    def wait_ready(self, models: list[str], timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited:\n{self.logs()}")
            with contextlib.suppress(httpx.HTTPError):
                states = httpx.get(f"{self.base_url}/health", timeout=2).json()["models"]
                if all(states.get(m) == "ready" for m in models):
                    return
                failed = [m for m in models if states.get(m) == "failed"]
                if failed:
                    raise RuntimeError(f"models failed: {failed}\n{self.logs()}")
            time.sleep(0.1)
        raise TimeoutError(f"gateway not ready in {timeout}s\n{self.logs()}")

    def ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "gateway", "--config", str(self.config), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=check)

    def admin(self, method: str, path: str, timeout: float = 10, **kw: Any) -> httpx.Response:
        """A call to the admin API, straight over the unix socket (gatewayctl has its own
        tests, and takes most of a second to start)."""
        transport = httpx.HTTPTransport(uds=str(self.run_dir / "admin.sock"))
        with httpx.Client(transport=transport, base_url="http://gw", timeout=timeout) as admin:
            return admin.request(method, path, **kw)

    def ps(self) -> dict[str, dict[str, Any]]:
        """The admin API's ps."""
        return {r["model"]: r for r in self.admin("GET", "/ps").json()}

    def load(self, model: str) -> None:
        """As `gatewayctl load MODEL`: once the model is ready."""
        self.admin("POST", "/load", timeout=120, json={"model": model}).raise_for_status()

    def unload(self, model: str) -> None:
        """As `gatewayctl unload MODEL`: once its workers are gone."""
        self.admin("POST", "/unload", timeout=60, json={"model": model}).raise_for_status()

    def reload(self, model: str) -> None:
        """As `gatewayctl reload MODEL`: once the new worker is ready."""
        self.admin("POST", "/reload", timeout=120, json={"model": model}).raise_for_status()

    def logs(self) -> str:
        text = (self.run_dir / "gateway.log").read_text(errors="replace")[-6000:]
        for log in sorted((self.run_dir / "logs").glob("*.log")):
            text += f"\n--- {log.name}\n" + log.read_text(errors="replace")[-4000:]
        return text

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


@contextlib.contextmanager
def running_gateway(
    models: list[dict[str, Any]], env: dict[str, str] | None = None, **server: Any
) -> Iterator[GatewayProc]:
    with serving(GatewayProc(models, env, **server)) as gw:
        yield gw


@contextlib.contextmanager
def serving(gw: GatewayProc) -> Iterator[GatewayProc]:
    """A gateway started before (tests that each need their own can start them together, a
    core each, then take them in turn): once its preloaded models are ready; stopped after."""
    try:
        gw.wait_ready(gw.preloaded)
        yield gw
    finally:
        gw.stop()


def openai_client(gw: GatewayProc, timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.base_url}/v1", api_key="x", max_retries=0, timeout=timeout)


def wait_for(predicate: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")
