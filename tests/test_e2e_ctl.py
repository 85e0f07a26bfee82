"""gatewayctl's catalog commands through a real gateway: `ls`, `rm` (refused while the model is
loaded), `pull` (offline: a clear error; a local folder: checked), `load --source --save` and
`chat` in a pseudo-terminal (a message in, a streamed reply out), `logs -f` following a
model's log across a reload."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from shared.config import load_config
from tests.gateway_proc import GatewayProc, running_gateway
from tests.hub_cache import fake_hub_repo

ENCODER = json.dumps({"model_type": "bert"}).encode()
ANSI = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hub")


@pytest.fixture(scope="module")
def env(hub_cache: Path) -> dict[str, str]:
    """No download leaves the machine; the hub cache is the test's own."""
    keep = {k: v for k, v in os.environ.items() if k != "MLX_GATEWAY_API_KEY"}
    return {**keep, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def gw(chat_model: Path, env: dict[str, str]) -> Iterator[GatewayProc]:
    models = [
        {"name": "chat", "source": str(chat_model), "engine": {"max_context": 256}},
        {"name": "hubbed", "source": "org/tiny-encoder", "preload": False},
    ]
    with running_gateway(models, env=env) as gateway:
        yield gateway


def ctl(gw: GatewayProc, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "gateway", "--config", str(gw.config), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)


def test_ls_lists_kind_size_and_state(
    gw: GatewayProc, env: dict[str, str], hub_cache: Path, chat_model: Path
) -> None:
    fake_hub_repo(hub_cache, "org/tiny-encoder", {"config.json": ENCODER, "x.safetensors": b"0"})
    out = ctl(gw, env, "ls")
    assert out.returncode == 0, out.stderr
    header, *lines = out.stdout.splitlines()
    assert header.split() == ["MODEL", "KIND", "SIZE", "STATE", "SOURCE"]
    rows = {line.split()[0]: line for line in lines}
    assert re.search(r"^chat +llm +[\d.]+ (KiB|MiB) +ready +/", rows["chat"])
    assert re.search(r"^hubbed +embedding +\d+ B +unloaded +org/tiny-encoder$", rows["hubbed"])
    listing = json.loads(ctl(gw, env, "ls", "--json").stdout)
    assert listing["gateway_running"] is True
    chat = next(m for m in listing["models"] if m["name"] == "chat")
    on_disk = sum(p.stat().st_size for p in chat_model.rglob("*") if p.is_file())
    assert chat["size_bytes"] == on_disk and chat["state"] == "ready" and chat["configured"]


def test_ls_without_a_gateway_says_so(gw: GatewayProc, env: dict[str, str], tmp_path: Path) -> None:
    out = ctl(gw, env, "--run-dir", str(tmp_path), "ls")
    assert out.returncode == 0 and "no gateway is running" in out.stdout
    assert re.search(r"^chat +llm +\S+ \S+ +- ", out.stdout, re.M)


def test_rm_refuses_a_loaded_model_and_a_local_folder(
    gw: GatewayProc, env: dict[str, str], chat_model: Path, other_model: Path
) -> None:
    for target in ("chat", str(chat_model)):
        out = ctl(gw, env, "rm", target, "--yes")
        assert out.returncode == 1 and "chat is ready: unload it first" in out.stderr
    out = ctl(gw, env, "rm", str(other_model), "--yes")
    assert out.returncode == 1 and "a local folder, not in the hub cache" in out.stderr
    assert chat_model.is_dir() and other_model.is_dir()


def test_rm_deletes_a_hub_model_from_the_cache(
    gw: GatewayProc, env: dict[str, str], hub_cache: Path
) -> None:
    fake_hub_repo(hub_cache, "org/gone", {"config.json": ENCODER})
    out = ctl(gw, env, "rm", "org/gone")  # no terminal to ask on, no --yes
    assert out.returncode == 1 and "pass --yes" in out.stderr
    out = ctl(gw, env, "rm", "org/gone", "--yes")
    assert out.returncode == 0 and "deleted org/gone from the hub cache" in out.stdout
    assert not (hub_cache / "models--org--gone").exists()


def test_pull_offline_fails_clearly_and_checks_a_local_folder(
    gw: GatewayProc, env: dict[str, str], other_model: Path, tmp_path: Path
) -> None:
    out = ctl(gw, env, "pull", "org/not-downloaded")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip() == (
        f"gatewayctl pull: org/not-downloaded: not in the hub cache ({env['HF_HUB_CACHE']}) "
        "and downloads are off (HF_HUB_OFFLINE is set)"
    )
    out = ctl(gw, env, "pull", str(other_model))
    assert out.returncode == 0, out.stderr
    assert f"{other_model}: a model folder (llm, " in out.stdout
    out = ctl(gw, env, "pull", str(tmp_path))
    assert out.returncode == 1 and "no config.json: not a model folder" in out.stderr


def test_load_source_save_keeps_the_model_in_the_config(
    gw: GatewayProc, env: dict[str, str], other_model: Path
) -> None:
    out = ctl(gw, env, "load", "extra", "--source", str(other_model), "--alias", "x", "--save")
    assert out.returncode == 0, out.stderr
    assert "extra: ready" in out.stdout and f"saved in {gw.config}" in out.stdout
    saved = {m.name: m for m in load_config(gw.config).models}["extra"]
    assert saved.source == str(other_model) and saved.aliases == ["x"]
    assert "(run time)" not in ctl(gw, env, "ls").stdout
    ctl(gw, env, "unload", "extra")
    no_file = {k: v for k, v in env.items() if k != "MLX_GATEWAY_CONFIG"}
    cmd = [sys.executable, "-m", "gateway", "--run-dir", str(gw.run_dir), "load", "y"]
    cmd += ["--source", str(other_model), "--save"]
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=no_file)
    assert refused.returncode == 1 and "--save needs a config file" in refused.stderr


class Terminal:
    """gatewayctl in a pseudo-terminal: reads are bounded by deadlines, never by sleeps."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.master, slave = os.openpty()
        self.proc = subprocess.Popen(
            args, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True
        )
        os.close(slave)
        self.seen = b""

    def read_until(self, marker: bytes, timeout: float = 30.0) -> bytes:
        """Output up to and including the next `marker`."""
        deadline = time.monotonic() + timeout
        while marker not in self.seen:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {marker!r} in {self.seen!r}")
            if select.select([self.master], [], [], left)[0]:
                try:
                    self.seen += os.read(self.master, 4096)
                except OSError:  # the process ended: the terminal is gone
                    raise AssertionError(f"no {marker!r} in {self.seen!r}") from None
        head, _, self.seen = self.seen.partition(marker)
        return ANSI.sub(b"", head + marker)

    def send(self, line: str) -> None:
        os.write(self.master, line.encode() + b"\n")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        os.close(self.master)


def test_chat_in_a_terminal_streams_a_reply(gw: GatewayProc, env: dict[str, str]) -> None:
    served = gw.ps()["chat"]["served"]
    args = [sys.executable, "-m", "gateway", "--config", str(gw.config), "chat", "chat"]
    term = Terminal([*args, "--max-tokens", "12", "--system", "Be brief."], env)
    try:
        assert b"chatting with chat" in term.read_until(b">>> ")
        term.send("hello there")
        reply = term.read_until(b">>> ").split(b"hello there", 1)[1].removesuffix(b">>> ")
        assert reply.strip(), "an empty reply"
        assert gw.ps()["chat"]["served"] == served + 1
        term.send("and again")  # the history goes with it: two user turns, one reply
        assert term.read_until(b">>> ").split(b"and again", 1)[1].strip(b"> \r\n")
        term.send("/exit")
        assert term.proc.wait(20) == 0
    finally:
        term.close()


def test_logs_follow(gw: GatewayProc) -> None:
    loads = (gw.run_dir / "logs" / "worker-chat.log").read_text().count("loading model chat")
    cmd = [sys.executable, "-m", "gateway", "--config", str(gw.config), "logs", "chat", "-f"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        seen = _read_until(proc, lambda text: "ready in" in text)
        assert "ready in" in seen
        gw.ctl("reload", "chat")  # a new worker writes to the same log

        def reloaded(text: str) -> bool:
            return text.count("loading model chat") > loads

        assert reloaded(_read_until(proc, reloaded, seen))
    finally:
        proc.kill()
        proc.wait(10)


def _read_until(proc: Any, done: Callable[[str], bool], seen: str = "") -> str:
    """`seen` and what `proc` writes next, up to where `done` holds of it all (or 30 s)."""
    box: list[str] = []
    deadline = time.monotonic() + 30
    while not done(seen) and time.monotonic() < deadline:
        reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(max(0.1, deadline - time.monotonic()))
        if box:
            seen += box.pop()
    return seen


def test_chat_needs_a_key_once_keys_exist(gw: GatewayProc, env: dict[str, str]) -> None:
    """Last in the module: a key turns authentication on for the gateway."""
    key = ctl(gw, env, "keys", "create", "chatter").stdout.strip()
    try:
        cmd = [sys.executable, "-m", "gateway", "--config", str(gw.config), "chat", "chat"]
        cmd += ["--max-tokens", "4"]
        run = subprocess.run(cmd, input="hi\n", capture_output=True, text=True, timeout=60, env=env)
        assert run.returncode == 1 and "Traceback" not in run.stderr
        assert "401" in run.stderr and "MLX_GATEWAY_API_KEY" in run.stderr
        keyed = {**env, "MLX_GATEWAY_API_KEY": key}
        run = subprocess.run(
            cmd, input="hi\n", capture_output=True, text=True, timeout=60, env=keyed
        )
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip()
    finally:
        ctl(gw, env, "keys", "revoke", "chatter")
