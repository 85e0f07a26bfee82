"""How a sharded model's ranks find each other, over MLX's ring backend (the default), MPI
or NCCL.

Ring: the supervisor starts each rank itself with the variables the ring backend reads (the
ones mlx.launch sets); for a group over several machines, each rank's address and the ssh
command that starts it there. A rank on another machine is started through `ssh -tt`: the
remote process then has a terminal, and when the gateway ends the ssh client (the group
stops, or a rank died) the remote side hangs up and the rank exits with it: no rank
outlives its group.

MPI: the supervisor starts Open MPI's `mpirun`, one application context per rank (rank 0 on
this machine), and mpirun starts the ranks (over ssh on other machines) and ends the whole
job when one of them dies.

NCCL (MLX's CUDA build): every rank on this machine, one GPU each; the supervisor starts
them with the variables MLX's NCCL backend reads (those mlx.launch sets): rank 0's address
and port, the rank, the group's size, and the one GPU the rank sees.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import ipaddress
import itertools
import json
import os
import re
import shlex
import shutil
import socket
from pathlib import Path
from typing import Literal

import msgspec

RANK_ENV = "MLX_RANK"  # this process's rank in the group
# where MPI says it: Open MPI's, then MPICH's and others' (PMI)
MPI_RANK_ENVS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK")
MPI_LIBNAME_ENV = "MLX_MPI_LIBNAME"  # which libmpi MLX opens (it looks for libmpi.so)
# what MLX's NCCL backend reads: rank 0's address and port, the group's size; and CUDA's
# list of the GPUs a process sees
NCCL_HOST_ENV, NCCL_PORT_ENV, WORLD_SIZE_ENV = "NCCL_HOST_IP", "NCCL_PORT", "MLX_WORLD_SIZE"
VISIBLE_GPUS_ENV = "CUDA_VISIBLE_DEVICES"
GATEWAY_PID_ENV = "MLX_GATEWAY_PID"  # rank 0 under mpirun: exit when this process is gone
HOSTFILE_ENV = "MLX_HOSTFILE"  # a JSON file: one list of "ip:port" per rank, each its own
MAX_SHARDS = 16  # worker processes of one sharded model
RING_PORT = 32323
# what a rank on another machine takes from the gateway's environment (the project's own
# switches: fault injection, step traces, the log format); the rest is that machine's (and
# the gateway's config, keys and pids stay here: a command line is readable by any user)
PASSED_ENV = ("MLX_GATEWAY_FAULTS", "MLX_GATEWAY_STEP_TRACE", "MLX_GATEWAY_LOG_FORMAT")
# where mpirun looks for the command that starts its daemon on another machine: Open MPI 4's
# name, and Open MPI 5's (PRRTE's)
RSH_AGENT_ENVS = ("OMPI_MCA_plm_rsh_agent", "PRTE_MCA_plm_ssh_agent")
# set for a rank whose host file is a temporary file of its machine: removed once read
TEMP_HOSTFILE_ENV = "MLX_GATEWAY_TEMP_HOSTFILE"
_USER = re.compile(r"[A-Za-z0-9._][A-Za-z0-9._-]*")


class Hosts(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Where a sharded model's ranks run ([models.hosts]); no `ranks`: all on this machine,
    over loopback."""

    # "[user@]IPv4 address" of each rank's machine, in rank order. Rank 0, the one that
    # talks to the gateway, runs here: its entry is an address of this machine (the one the
    # others reach it at), without a user. The others are started over ssh, unless their
    # entry is an address of this machine without a user.
    ranks: list[str] = []
    # The ring backend's ports: rank r listens on ring_port + r at its address, or on
    # ring_port + shards + r for the group that replaces a running one (a reload starts the
    # new group before the old one leaves): 2 x shards ports from ring_port.
    ring_port: int = RING_PORT
    # The ssh command and its options (key, port, ...); the target and the command follow.
    ssh: list[str] = msgspec.field(default_factory=lambda: ["ssh", "-o", "BatchMode=yes"])
    # The Python that has mlx-gateway installed on the other machines; default: the
    # gateway's own path (the same install layout on every machine).
    python: str | None = None
    # How the ranks talk: "ring" (MLX's own, over TCP), "mpi" (Open MPI's mpirun starts
    # them; user names then go in ssh's config, not in `ranks`) or "nccl" (MLX's CUDA
    # build: every rank on this machine, one GPU each).
    backend: Literal["ring", "mpi", "nccl"] = "ring"
    # backend "mpi": the mpirun command and its options (the ranks' contexts follow)
    mpirun: list[str] = msgspec.field(default_factory=lambda: ["mpirun"])


def rank_of(backend: str, env: dict[str, str] | None = None) -> int:
    """This process's rank: what MPI set (backend "mpi"), else the supervisor's MLX_RANK."""
    found = os.environ if env is None else env
    for name in MPI_RANK_ENVS if backend == "mpi" else (RANK_ENV,):
        if name in found:
            return int(found[name])
    return 0


def hostfile(ports: list[int], host: str = "127.0.0.1") -> str:
    """The ring backend's host file for ranks on `host`, rank r listening on ports[r]."""
    return json.dumps([[f"{host}:{port}"] for port in ports])


def split_entry(entry: str) -> tuple[str | None, str]:
    """A `ranks` entry's user (or None) and address."""
    user, sep, address = entry.rpartition("@")
    return (user if sep else None), address


def is_local(address: str) -> bool:
    """Whether `address` is one of this machine's (a socket can be bound to it)."""
    with contextlib.suppress(OSError), socket.socket() as sock:
        sock.bind((address, 0))
        return True
    return False


def check_group(
    shards: int,
    sharding: str,
    hosts: Hosts,
    remote: bool = False,
    not_text: bool = False,
    batcher: str = "auto",
) -> str | None:
    """What is wrong with a model's sharding settings (a setting that would do nothing
    included), or None."""
    if not 1 <= shards <= MAX_SHARDS:
        return f"shards must be between 1 and {MAX_SHARDS}"
    if shards == 1 and (hosts.ranks or sharding != "tensor"):
        return f"{'hosts.ranks' if hosts.ranks else 'sharding'} is for a sharded model (shards > 1)"
    if sharding == "pipeline" and batcher == "mlx_lm":
        # measured: other tokens than one process's on a prefix-cache hit
        return "sharding = 'pipeline' runs on the rows batch, not batcher = 'mlx_lm'"
    if shards == 1 and hosts.backend != "ring":
        return "hosts.backend is for a sharded model (shards > 1)"
    if hosts.backend != "ring" and hosts.ring_port != RING_PORT:
        return f"hosts.ring_port is for the ring backend, not backend = {hosts.backend!r}"
    if hosts.backend == "nccl" and hosts.ranks:
        return (
            "backend = 'nccl' runs every rank on this machine, one GPU each: hosts.ranks is "
            "for the ring and MPI backends"
        )
    if hosts.backend != "mpi" and hosts.mpirun != Hosts().mpirun:
        return "hosts.mpirun is for backend = 'mpi'"
    if hosts.backend == "mpi" and not (hosts.mpirun and hosts.mpirun[0]):
        return "hosts.mpirun must name the mpirun command"
    unused = [k for k in ("ring_port", "ssh", "python") if getattr(hosts, k) != getattr(Hosts(), k)]
    if unused and not hosts.ranks:
        return f"hosts.{unused[0]} is for ranks on several machines (hosts.ranks)"
    if shards > 1 and remote:
        return 'a sharded model\'s rank 0 runs on this machine (placement = "local")'
    if shards > 1 and not_text:
        return "only text models (kind llm) are sharded"
    return check_hosts(hosts, shards)


def check_hosts(hosts: Hosts, shards: int) -> str | None:
    """What is wrong with a model's [models.hosts] for its `shards`, or None."""
    if not hosts.ranks:
        return None
    if len(hosts.ranks) != shards:
        return f"hosts.ranks names {len(hosts.ranks)} machines for shards = {shards}: one per rank"
    for rank, entry in enumerate(hosts.ranks):
        user, address = split_entry(entry)
        try:
            ipaddress.IPv4Address(address)
        except ValueError:
            return (
                f"hosts.ranks[{rank}] = {entry!r}: the ring backend needs an IPv4 address "
                "([user@]address)"
            )
        if user is not None and not _USER.fullmatch(user):
            return f"hosts.ranks[{rank}] = {entry!r}: not a user name"
        if user is not None and hosts.backend == "mpi":
            return (
                f"hosts.ranks[{rank}] = {entry!r}: mpirun takes no user in a host; give it "
                "in ssh's config (~/.ssh/config) or in hosts.ssh (-l USER)"
            )
    addresses = [split_entry(e)[1] for e in hosts.ranks]
    if not all(is_local(a) for a in addresses):  # another machine: every rank is reached
        for rank, address in enumerate(addresses):
            if ipaddress.IPv4Address(address).is_loopback or address == "0.0.0.0":
                return (
                    f"hosts.ranks[{rank}] = {address!r}: the other machines reach this rank "
                    "at its address; give the machine's address on the link between them"
                )
    user, address = split_entry(hosts.ranks[0])
    if user is not None or not is_local(address):
        return (
            f"hosts.ranks[0] = {hosts.ranks[0]!r}: rank 0 talks to the gateway and runs on "
            "this machine: give this machine's address (the one the other machines reach), "
            "without a user"
        )
    if not 1024 <= hosts.ring_port <= 65536 - 2 * shards:
        return f"hosts.ring_port must be between 1024 and {65536 - 2 * shards}"
    if not hosts.ssh or not hosts.ssh[0]:
        return "hosts.ssh must name the ssh command"
    return None


def ring_hostfile(hosts: Hosts, turn: int = 0) -> str:
    """The ring backend's host file for ranks on several machines; `turn` 1 takes the second
    range of ports (a group that replaces a running one)."""
    base = hosts.ring_port + turn * len(hosts.ranks)
    return json.dumps([[f"{split_entry(e)[1]}:{base + r}"] for r, e in enumerate(hosts.ranks)])


def overlapping_rings(models: list[tuple[str, Hosts]]) -> str | None:
    """Two models over several machines whose ring ports overlap, said as an error."""
    spans = sorted(
        (h.ring_port, h.ring_port + 2 * len(h.ranks), name)
        for name, h in models
        if h.ranks and h.backend == "ring"  # MPI's ports are its own
    )
    for (_, end, first), (start, _, second) in itertools.pairwise(spans):
        if start < end:
            return (
                f"models {first!r} and {second!r}: their hosts.ring_port ranges overlap "
                "(each takes 2 x shards ports)"
            )
    return None


def nccl_env(rank: int, shards: int, port: int, visible: str | None) -> dict[str, str]:
    """The variables of one rank of a group over NCCL on this machine (rank 0 listening on
    `port`): its rank, the group's size, and its own GPU, the rank-th of those this process
    sees (`visible`, CUDA_VISIBLE_DEVICES, when set). ValueError when fewer are listed."""
    gpus = [g.strip() for g in visible.split(",") if g.strip()] if visible is not None else None
    if gpus is not None and len(gpus) < shards:
        raise ValueError(
            f"backend = 'nccl' needs a GPU for each of the {shards} ranks; "
            f"{VISIBLE_GPUS_ENV} lists {len(gpus)}"
        )
    return {
        RANK_ENV: str(rank),
        WORLD_SIZE_ENV: str(shards),
        NCCL_HOST_ENV: "127.0.0.1",
        NCCL_PORT_ENV: str(port),
        VISIBLE_GPUS_ENV: gpus[rank] if gpus is not None else str(rank),
    }


def runs_here(hosts: Hosts, rank: int) -> bool:
    """Whether the gateway starts this rank as a process of its own machine."""
    if not hosts.ranks:
        return True
    user, address = split_entry(hosts.ranks[rank])
    return user is None and is_local(address)


def remote_argv(
    hosts: Hosts, rank: int, argv: list[str], group: str, env: dict[str, str]
) -> list[str]:
    """The ssh command that starts `argv` (a worker's command line, its interpreter first)
    as `rank` on its machine: the group's host file written there, the rank and the project's
    switches from `env` exported, the interpreter replaced by `hosts.python` if set."""
    python = hosts.python or argv[0]
    exports = {k: env[k] for k in PASSED_ENV if k in env}
    exports["PYTHONUNBUFFERED"] = "1"
    exports[RANK_ENV] = str(rank)
    exports[TEMP_HOSTFILE_ENV] = "1"
    script = 'f=$(mktemp) && printf "%s" ' + shlex.quote(group) + ' > "$f" && '
    script += f'export {HOSTFILE_ENV}="$f" '
    script += " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(exports.items()))
    script += " && exec " + shlex.join([python, *argv[1:]])
    # through /bin/sh whatever the login shell (zsh on a Mac, or fish, csh...)
    return [*hosts.ssh, "-tt", hosts.ranks[rank], "exec /bin/sh -c " + shlex.quote(script)]


def mpi_launch(
    hosts: Hosts,
    shards: int,
    argv: list[str],
    env: dict[str, str],
    libmpi: str,
    agent: str | None,
) -> tuple[list[str], dict[str, str]]:
    """The mpirun command that starts `argv` (a worker's command line, its interpreter
    first) as each rank of a group, and mpirun's environment. One application context per
    rank, in rank order, each on its machine (this one's loopback when `hosts.ranks` is
    empty), `hosts.python` for the ranks elsewhere; ranks not bound to one core (Open MPI's
    default for small jobs, which would starve MLX's threads); the project's switches, the
    libmpi MLX opens and unbuffered output exported by name (`-x NAME`: the values stay off
    the command line). `agent` is the script that runs `hosts.ssh`, given to mpirun to start
    its daemon on other machines (a path: Open MPI splits the agent's text at spaces and
    colons)."""
    addresses = [split_entry(e)[1] for e in hosts.ranks] or ["127.0.0.1"] * shards
    launch_env = {**env, "PYTHONUNBUFFERED": "1", MPI_LIBNAME_ENV: libmpi}
    if agent is not None:
        launch_env.update(dict.fromkeys(RSH_AGENT_ENVS, agent))
    names = sorted({*(k for k in PASSED_ENV if k in env), "PYTHONUNBUFFERED", MPI_LIBNAME_ENV})
    options = [arg for name in names for arg in ("-x", name)]
    command = [hosts.mpirun[0]]
    if "--bind-to" not in hosts.mpirun:
        command += ["--bind-to", "none"]
    command += hosts.mpirun[1:]
    for rank, address in enumerate(addresses):
        python = argv[0] if rank == 0 or is_local(address) else hosts.python or argv[0]
        slots = addresses.count(address)
        command += [*([":"] if rank else []), *options, "-np", "1", "--host", f"{address}:{slots}"]
        command += [python, *argv[1:]]
    return command, launch_env


def agent_script(hosts: Hosts) -> str:
    """The script mpirun runs to reach another machine: `hosts.ssh`, then mpirun's target
    and command."""
    return "#!/bin/sh\nexec " + shlex.join(hosts.ssh) + ' "$@"\n'


def find_libmpi(mpirun: str) -> str | None:
    """The libmpi beside `mpirun`'s install (Homebrew, conda: ../lib), else the system's
    (libmpi.so.40 without the development package's libmpi.so), or None."""
    path = shutil.which(mpirun)
    if path is not None:
        lib = Path(path).resolve().parent.parent / "lib"
        # the versioned library first: libmpi.so may be a linker script, not a library
        for pattern in ("libmpi.*.dylib", "libmpi.so.*", "libmpi.dylib", "libmpi.so"):
            found = sorted(lib.glob(pattern))
            if found:
                return str(found[0])
    return ctypes.util.find_library("mpi")
