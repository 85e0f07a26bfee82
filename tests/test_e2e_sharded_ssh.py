"""A model sharded over two "machines": rank 0 here, rank 1 started through a real OpenSSH
server on loopback ([models.hosts]), the ring backend between them at the configured
addresses and ports. Greedy output is the single-process model's; rank 1 is a process of
the ssh server's session, not of the gateway; killing it restarts the group, and an unload
ends it over the hung-up terminal."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest

from tests.gateway_proc import GatewayProc, openai_client, running_gateway, wait_for
from tests.remote_workers import kill9
from tests.sshd import Sshd, available, running_sshd
from tests.test_e2e_sharded import PROMPTS, greedy, tokens

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))


def _two_free_ports() -> int:
    """A port p such that p and p + 1 are free on loopback now."""
    for _ in range(50):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port < 65535:
            with socket.socket() as other:
                try:
                    other.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    with running_sshd(tmp_path_factory.mktemp("sshd")) as server:
        yield server


@pytest.fixture(scope="module")
def gw(chat_model: Path, sshd: Sshd) -> Iterator[GatewayProc]:
    hosts = {
        "ranks": ["127.0.0.1", f"{sshd.user}@127.0.0.1"],
        "ring_port": _two_free_ports(),
        "ssh": sshd.ssh,
    }
    closed = _two_free_ports()  # nothing listens there: ssh cannot reach that "machine"
    nowhere = {
        "ranks": ["127.0.0.1", "nobody@127.0.0.1"],
        "ring_port": closed,
        "ssh": [*sshd.ssh, "-p", str(closed)],  # the last -p wins
    }
    models = [
        {"name": "single", "source": str(chat_model)},
        {"name": "sharded", "source": str(chat_model), "shards": 2, "hosts": hosts},
        {
            "name": "unreachable",
            "source": str(chat_model),
            "shards": 2,
            "hosts": nowhere,
            "preload": False,
        },
    ]
    # a killed rank's group restarts after 0.2 s, not the default 1 s
    with running_gateway(models, request_timeout_s=60.0, restart_backoff_s=0.2) as gateway:
        yield gateway


def _remote_rank(gw: GatewayProc) -> psutil.Process:
    """Rank 1: the worker process with this group's id and MLX_RANK 1, under sshd."""
    worker_id = gw.ps()["sharded"]["replicas"][0]["worker_id"]
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "worker" in cmdline and worker_id in cmdline:
            try:
                if process.environ().get("MLX_RANK") == "1":
                    return process
            except psutil.Error:
                continue
    raise AssertionError(f"no rank 1 of {worker_id}")


def _under_sshd(process: psutil.Process) -> bool:
    return any(p.name().startswith("sshd") for p in process.parents())


def test_greedy_output_is_the_single_process_models(gw: GatewayProc, sshd: Sshd) -> None:
    client = openai_client(gw)
    for prompt in PROMPTS:
        one, two = greedy(client, "single", prompt), greedy(client, "sharded", prompt)
        assert tokens(two) == tokens(one) and len(tokens(one)) == 24
    rank = _remote_rank(gw)
    assert _under_sshd(rank)  # started through ssh, not by the gateway
    assert gw.proc.pid not in [p.pid for p in rank.parents()]
    replica = gw.ps()["sharded"]["replicas"][0]
    assert replica["rank_hosts"] == ["127.0.0.1", f"{sshd.user}@127.0.0.1"]


def test_a_reload_starts_the_new_group_beside_the_old(gw: GatewayProc) -> None:
    # the ring's ports are fixed over several machines: the new group takes the other range
    old = _remote_rank(gw)
    gw.reload("sharded")
    fresh = _remote_rank(gw)
    assert fresh.pid != old.pid and _under_sshd(fresh)
    client = openai_client(gw)
    assert tokens(greedy(client, "sharded", PROMPTS[1])) == tokens(
        greedy(client, "single", PROMPTS[1])
    )
    wait_for(lambda: not old.is_running(), 30, "the old group gone")


def test_a_killed_remote_rank_restarts_the_group(gw: GatewayProc) -> None:
    before = gw.ps()["sharded"]
    rank = _remote_rank(gw)
    kill9(rank.pid)

    def restarted() -> bool:
        row = gw.ps()["sharded"]
        return row["restarts"] > before["restarts"] and row["state"] == "ready"

    wait_for(restarted, 90, "the group restarted")
    error = gw.ps()["sharded"]["last_error"]
    assert "rank 1 (on " in error and "over ssh) of its 2-process group exited" in error
    fresh = _remote_rank(gw)
    assert fresh.pid != rank.pid and _under_sshd(fresh)
    client = openai_client(gw)
    assert tokens(greedy(client, "sharded", PROMPTS[0])) == tokens(
        greedy(client, "single", PROMPTS[0])
    )


def test_an_unload_ends_the_remote_rank(gw: GatewayProc) -> None:
    rank = _remote_rank(gw)
    gw.unload("sharded")
    assert gw.ps()["sharded"]["state"] == "unloaded"
    wait_for(lambda: not rank.is_running(), 20, "the remote rank gone with its terminal")


def test_a_machine_ssh_cannot_reach_fails_the_load_saying_so(gw: GatewayProc) -> None:
    client = openai_client(gw)
    with pytest.raises(openai.APIStatusError) as failed:
        greedy(client, "unreachable", PROMPTS[0])
    assert failed.value.status_code == 503
    message = str(failed.value)
    assert "rank 1 (on nobody@127.0.0.1, over ssh)" in message
    assert "exit status 255, ssh's 255: the machine was not reached" in message
