"""shared/sharding.py: where a sharded model's ranks run, checked at config load, and the
ssh command that starts a rank on another machine."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from shared.sharding import (
    HOSTFILE_ENV,
    RANK_ENV,
    TEMP_HOSTFILE_ENV,
    Hosts,
    check_hosts,
    remote_argv,
    ring_hostfile,
    runs_here,
    split_entry,
)


def test_entries_are_an_optional_user_and_an_address() -> None:
    assert split_entry("10.0.0.2") == (None, "10.0.0.2")
    assert split_entry("me@10.0.0.2") == ("me", "10.0.0.2")


@pytest.mark.parametrize(
    ("ranks", "shards", "problem"),
    [
        (["127.0.0.1"], 2, "names 1 machines for shards = 2"),
        (["127.0.0.1", "mac-mini.local"], 2, "needs an IPv4 address"),
        (["127.0.0.1", "bad user@10.0.0.2"], 2, "not a user name"),
        (["me@127.0.0.1", "10.0.0.2"], 2, "rank 0 talks to the gateway"),
        (["203.0.113.7", "10.0.0.2"], 2, "rank 0 talks to the gateway"),  # not this machine's
    ],
)
def test_bad_hosts_are_refused_saying_why(ranks: list[str], shards: int, problem: str) -> None:
    found = check_hosts(Hosts(ranks=ranks), shards)
    assert found is not None and problem in found


def test_good_hosts_pass_and_none_means_loopback() -> None:
    assert check_hosts(Hosts(), 2) is None
    assert check_hosts(Hosts(ranks=["127.0.0.1", "me@10.0.0.2"]), 2) is None
    assert "ring_port" in str(check_hosts(Hosts(ranks=["127.0.0.1", "10.0.0.2"], ring_port=80), 2))
    assert "ssh" in str(check_hosts(Hosts(ranks=["127.0.0.1", "10.0.0.2"], ssh=[]), 2))


def test_the_ring_lists_each_ranks_address_and_port() -> None:
    hosts = Hosts(ranks=["127.0.0.1", "me@10.0.0.2", "10.0.0.3"], ring_port=40000)
    assert json.loads(ring_hostfile(hosts)) == [
        ["127.0.0.1:40000"],
        ["10.0.0.2:40001"],
        ["10.0.0.3:40002"],
    ]
    assert runs_here(hosts, 0) and not runs_here(hosts, 1) and not runs_here(hosts, 2)
    # an address of this machine with a user still goes through ssh (a login of its own)
    assert not runs_here(Hosts(ranks=["127.0.0.1", "me@127.0.0.1"]), 1)
    assert runs_here(Hosts(ranks=["127.0.0.1", "127.0.0.1"]), 1)


def test_the_remote_command_writes_the_ring_and_execs_the_worker() -> None:
    hosts = Hosts(ranks=["127.0.0.1", "me@10.0.0.2"], ssh=["ssh", "-p", "2222"])
    group = ring_hostfile(hosts)
    argv = [sys.executable, "-m", "worker", "--id", "w-1", "--model", '{"name": "it\'s"}']
    env = {"MLX_GATEWAY_FAULTS": "x", "HOME": "/home/gw", "LD_PRELOAD": "libopenblas.so"}
    command = remote_argv(hosts, 1, argv, group, env)
    assert command[:5] == ["ssh", "-p", "2222", "-tt", "me@10.0.0.2"]
    script = command[5]
    assert "LD_PRELOAD" not in script and "HOME" not in script  # that machine's own
    # run here by a shell (as sshd would), the script leaves the worker's exact argv, the
    # ring's file and the rank, and the project's switches
    probe = script.replace(
        "exec " + shlex.join([sys.executable, *argv[1:]]),
        "exec " + shlex.join([sys.executable, "-c", _SHOW, *argv[1:]]),
    )
    shown = json.loads(subprocess.run(["sh", "-c", probe], capture_output=True, check=True).stdout)
    assert shown["argv"] == argv[1:]
    assert shown["env"][RANK_ENV] == "1" and shown["env"][TEMP_HOSTFILE_ENV] == "1"
    assert shown["env"]["MLX_GATEWAY_FAULTS"] == "x"
    assert shown["ring"] == group
    with_python = remote_argv(Hosts(ranks=hosts.ranks, python="/opt/py"), 1, argv, group, {})
    assert "exec /opt/py -m worker" in with_python[-1]


_SHOW = """
import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "env": dict(os.environ),
                  "ring": open(os.environ["HOSTFILE"]).read()}))
""".replace("HOSTFILE", HOSTFILE_ENV)
