"""shared/sharding.py: where a sharded model's ranks run, checked at config load, the ssh
command that starts a rank on another machine, and the mpirun command of a group over MPI."""

from __future__ import annotations

import ctypes.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from shared.sharding import (
    GATEWAY_PID_ENV,
    HOSTFILE_ENV,
    MPI_LIBNAME_ENV,
    RANK_ENV,
    TEMP_HOSTFILE_ENV,
    Hosts,
    agent_script,
    check_group,
    check_hosts,
    find_libmpi,
    mpi_launch,
    nccl_env,
    overlapping_rings,
    rank_of,
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
        (["me@127.0.0.1", "127.0.0.1"], 2, "rank 0 talks to the gateway"),
        (["203.0.113.7", "10.0.0.2"], 2, "rank 0 talks to the gateway"),  # not this machine's
        (["127.0.0.1", "10.0.0.2"], 2, "the other machines reach this rank at its address"),
        (["203.0.113.7", "10.0.0.2", "me@127.0.0.1"], 3, "hosts.ranks[2] = '127.0.0.1'"),
    ],
)
def test_bad_hosts_are_refused_saying_why(ranks: list[str], shards: int, problem: str) -> None:
    found = check_hosts(Hosts(ranks=ranks), shards)
    assert found is not None and problem in found


def test_good_hosts_pass_and_none_means_loopback() -> None:
    assert check_hosts(Hosts(), 2) is None
    assert check_hosts(Hosts(ranks=["127.0.0.1", "127.0.0.1"]), 2) is None  # all here
    assert check_hosts(Hosts(ranks=["127.0.0.1", "me@127.0.0.1"]), 2) is None
    here = ["127.0.0.1", "me@127.0.0.1"]
    assert "ring_port" in str(check_hosts(Hosts(ranks=here, ring_port=80), 2))
    assert "ssh" in str(check_hosts(Hosts(ranks=here, ssh=[]), 2))


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
    # the worker's argv, its interpreter made to show what it was given instead
    argv = [sys.executable, "-c", _SHOW, "-m", "worker", "--id", "w-1"]
    argv += ["--model", '{"name": "it\'s $HOME `x` !"}']
    env = {"MLX_GATEWAY_FAULTS": "x", "HOME": "/home/gw", "LD_PRELOAD": "libopenblas.so"}
    env |= {"MLX_GATEWAY_CONFIG_JSON": '{"keys": 1}', "MLX_GATEWAY_API_KEY": "sk-1"}
    command = remote_argv(hosts, 1, argv, group, env)
    assert command[:5] == ["ssh", "-p", "2222", "-tt", "me@10.0.0.2"]
    remote = command[5]  # what sshd hands the login shell: /bin/sh whatever that shell is
    assert remote.startswith("exec /bin/sh -c ")
    assert "LD_PRELOAD" not in remote and "HOME=" not in remote  # that machine's own
    assert "CONFIG_JSON" not in remote and "sk-1" not in remote  # the gateway's: stays here
    # run by a login shell here: the worker's exact argv, the ring's file and the rank, and
    # the project's switches
    for shell in ("sh", "bash"):
        done = subprocess.run([shell, "-c", remote], capture_output=True, check=True)
        shown = json.loads(done.stdout)
        assert shown["argv"] == argv[3:]
        assert shown["env"][RANK_ENV] == "1" and shown["env"][TEMP_HOSTFILE_ENV] == "1"
        assert shown["env"]["MLX_GATEWAY_FAULTS"] == "x"
        assert shown["ring"] == group
    with_python = remote_argv(Hosts(ranks=hosts.ranks, python="/opt/py"), 1, argv, group, {})
    assert "exec /opt/py -c" in with_python[-1]


def test_a_replacing_group_takes_the_second_port_range() -> None:
    hosts = Hosts(ranks=["127.0.0.1", "10.0.0.2"], ring_port=40000)
    assert json.loads(ring_hostfile(hosts, 1)) == [["127.0.0.1:40002"], ["10.0.0.2:40003"]]
    here = ["127.0.0.1", "me@127.0.0.1"]
    assert "between 1024 and 65532" in str(check_hosts(Hosts(here, 65534), 2))
    assert overlapping_rings([("a", hosts), ("b", Hosts(hosts.ranks, 40004))]) is None
    clash = overlapping_rings([("a", hosts), ("b", Hosts(hosts.ranks, 40003))])
    assert clash is not None and "'a' and 'b'" in clash
    # ranks all on this machine take free ports: never in the way
    assert overlapping_rings([("a", hosts), ("c", Hosts())]) is None


def test_pipelines_run_on_the_rows_batch_only() -> None:
    assert "rows batch" in str(check_group(2, "pipeline", Hosts(), batcher="mlx_lm"))
    assert check_group(2, "pipeline", Hosts()) is None
    assert check_group(2, "tensor", Hosts(), batcher="mlx_lm") is None


def test_settings_that_would_do_nothing_are_refused() -> None:
    assert "sharding is for a sharded model" in str(check_group(1, "pipeline", Hosts()))
    spread = Hosts(ranks=["127.0.0.1"])
    assert "hosts.ranks is for a sharded model" in str(check_group(1, "tensor", spread))
    for setting in ({"ring_port": 40000}, {"ssh": ["ssh", "-p", "2"]}, {"python": "/py"}):
        problem = check_group(2, "tensor", Hosts(**setting))  # type: ignore[arg-type]
        assert f"hosts.{next(iter(setting))} is for ranks on several machines" in str(problem)
    assert check_group(1, "tensor", Hosts()) is None


def test_nccl_settings_are_checked() -> None:
    nccl = Hosts(backend="nccl")
    assert check_group(2, "tensor", nccl) is None
    assert "hosts.backend is for a sharded model" in str(check_group(1, "tensor", nccl))
    spread = Hosts(ranks=["127.0.0.1", "127.0.0.2"], backend="nccl")
    assert "runs every rank on this machine" in str(check_group(2, "tensor", spread))
    fixed = Hosts(ring_port=40000, backend="nccl")
    assert "not backend = 'nccl'" in str(check_group(2, "tensor", fixed))
    assert "hosts.mpirun is for backend = 'mpi'" in str(
        check_group(2, "tensor", Hosts(backend="nccl", mpirun=["/opt/mpirun"]))
    )


def test_each_nccl_rank_sees_its_own_gpu() -> None:
    first, second = (nccl_env(r, 2, 41000, None) for r in range(2))
    assert first == {
        "MLX_RANK": "0",
        "MLX_WORLD_SIZE": "2",
        "NCCL_HOST_IP": "127.0.0.1",
        "NCCL_PORT": "41000",
        "CUDA_VISIBLE_DEVICES": "0",
    }
    assert second["MLX_RANK"] == "1" and second["CUDA_VISIBLE_DEVICES"] == "1"
    # a gateway already limited to some GPUs hands them out in order
    assert nccl_env(1, 2, 41000, "2, 5")["CUDA_VISIBLE_DEVICES"] == "5"
    with pytest.raises(ValueError, match="needs a GPU for each of the 3 ranks"):
        nccl_env(0, 3, 41000, "2,5")


def test_mpi_settings_are_checked() -> None:
    mpi = Hosts(backend="mpi")
    assert check_group(2, "tensor", mpi) is None
    assert "hosts.backend is for a sharded model" in str(check_group(1, "tensor", mpi))
    spread = Hosts(ranks=["127.0.0.1", "127.0.0.2"], backend="mpi")
    assert check_group(2, "tensor", spread) is None
    fixed = Hosts(ranks=spread.ranks, ring_port=40000, backend="mpi")
    assert "hosts.ring_port is for the ring backend" in str(check_group(2, "tensor", fixed))
    user = Hosts(ranks=["127.0.0.1", "me@127.0.0.2"], backend="mpi")
    assert "mpirun takes no user in a host" in str(check_group(2, "tensor", user))
    assert "hosts.mpirun is for backend = 'mpi'" in str(
        check_group(2, "tensor", Hosts(mpirun=["/opt/mpirun"]))
    )
    assert "must name the mpirun command" in str(
        check_group(2, "tensor", Hosts(backend="mpi", mpirun=[]))
    )


def test_the_mpirun_command_has_one_context_per_rank_rank_0_here() -> None:
    argv = [sys.executable, "-m", "worker", "--id", "w", "--model", "{}"]
    secret = {"MLX_GATEWAY_CONFIG_JSON": "{...}", "MLX_GATEWAY_API_KEY": "sk-1", "HOME": "/h"}
    env = {"MLX_GATEWAY_FAULTS": "x", GATEWAY_PID_ENV: "1", **secret}
    hosts = Hosts(
        ranks=["127.0.0.1", "10.0.0.2", "10.0.0.2"],
        backend="mpi",
        mpirun=["mpirun", "--allow-run-as-root"],
        python="/opt/py",
    )
    command, launch = mpi_launch(hosts, 3, argv, env, "libmpi.so.40", "/tmp/a/ssh")
    head = ["mpirun", "--bind-to", "none", "--allow-run-as-root"]
    assert command[: len(head)] == head
    contexts = " ".join(command[len(head) :]).split(" : ")
    assert len(contexts) == 3
    # exported by name: mpirun takes the values from its environment
    exported = f"-x MLX_GATEWAY_FAULTS -x {MPI_LIBNAME_ENV} -x PYTHONUNBUFFERED"
    worker = " ".join(argv[1:])
    assert contexts[0] == f"{exported} -np 1 --host 127.0.0.1:1 {sys.executable} {worker}"
    assert contexts[1] == f"{exported} -np 1 --host 10.0.0.2:2 /opt/py {worker}"
    assert contexts[2] == contexts[1]
    assert launch[MPI_LIBNAME_ENV] == "libmpi.so.40" and launch["PYTHONUNBUFFERED"] == "1"
    assert launch["OMPI_MCA_plm_rsh_agent"] == launch["PRTE_MCA_plm_ssh_agent"] == "/tmp/a/ssh"
    # nothing of the gateway's own environment is on the command line or sent elsewhere
    assert not any(value in " ".join(command) for value in secret.values())
    assert GATEWAY_PID_ENV not in command and "MLX_GATEWAY_CONFIG_JSON" not in command
    # all on this machine: loopback, no ssh; a binding asked for is kept
    here, launch = mpi_launch(Hosts(backend="mpi"), 2, argv, {}, "libmpi.so.40", None)
    assert here.count("127.0.0.1:2") == 2 and "OMPI_MCA_plm_rsh_agent" not in launch
    bound = Hosts(backend="mpi", mpirun=["mpirun", "--bind-to", "socket"])
    assert mpi_launch(bound, 2, argv, {}, "l", None)[0][:3] == ["mpirun", "--bind-to", "socket"]


def test_the_ssh_script_keeps_every_argument_whole(tmp_path: Path) -> None:
    # Open MPI splits an agent's text at spaces and colons: it gets this script's path
    show = tmp_path / "show"
    show.write_text('#!/bin/sh\nfor a in "$@"; do echo "[$a]"; done\n')
    show.chmod(0o755)
    agent = tmp_path / "ssh"
    agent.write_text(agent_script(Hosts(ssh=[str(show), "-i", "my key", "-o", "A=b:c"])))
    agent.chmod(0o755)
    out = subprocess.run([str(agent), "10.0.0.2", "orted --x"], capture_output=True, text=True)
    assert out.stdout.splitlines() == [
        "[-i]",
        "[my key]",
        "[-o]",
        "[A=b:c]",
        "[10.0.0.2]",
        "[orted --x]",
    ]


def test_mpi_groups_take_no_ring_ports() -> None:
    spread = ["127.0.0.1", "127.0.0.2"]
    rings = [("a", Hosts(spread, backend="mpi")), ("b", Hosts(spread, backend="mpi"))]
    assert overlapping_rings(rings) is None
    assert overlapping_rings([*rings, ("c", Hosts(spread))]) is None


def test_ranks_read_theirs_from_the_supervisor_or_from_mpi() -> None:
    assert rank_of("ring", {}) == 0
    assert rank_of("ring", {RANK_ENV: "2", "OMPI_COMM_WORLD_RANK": "3"}) == 2
    assert rank_of("mpi", {RANK_ENV: "2", "OMPI_COMM_WORLD_RANK": "3"}) == 3
    assert rank_of("mpi", {"PMI_RANK": "1"}) == 1


def test_libmpi_is_found_beside_mpirun(tmp_path: Path) -> None:
    bin_dir, lib = tmp_path / "bin", tmp_path / "lib"
    bin_dir.mkdir()
    lib.mkdir()
    mpirun = bin_dir / "mpirun"
    mpirun.write_text("#!/bin/sh\n")
    mpirun.chmod(0o755)
    (lib / "libmpi.so.40").write_text("")
    (lib / "libmpi.so").write_text("INPUT(libmpi.so.40)")  # a linker script: not dlopen's
    assert find_libmpi(str(mpirun)) == str(lib / "libmpi.so.40")
    (lib / "libmpi.so").unlink()
    (lib / "libmpi.so.40").unlink()
    # none beside it: the system's, as the loader names it (or none at all)
    assert find_libmpi(str(mpirun)) == ctypes.util.find_library("mpi")


_SHOW = """
import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "env": dict(os.environ),
                  "ring": open(os.environ["HOSTFILE"]).read()}))
""".replace("HOSTFILE", HOSTFILE_ENV)
