"""gateway/ctl/server.py's checks before a gateway serves: its run directory is its own
(this gateway's alone, its user's, a directory whose sockets' paths fit), its port is free
(and in range)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from gateway.ctl.server import _own, _port_free
from shared.paths import RunDir, RunDirError


def test_a_run_directory_serves_one_gateway(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run")
    run_dir.create()
    first = _own(run_dir)
    run_dir.pid_file.write_text("4242")
    with pytest.raises(SystemExit, match=r"another gateway \(pid 4242\) serves from"):
        _own(run_dir)
    first.close()  # it ended: the next one may
    _own(run_dir).close()


def test_a_port_in_use_or_out_of_range_is_said_in_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit, match=f"127.0.0.1:{port} is in use already"):
            _port_free("127.0.0.1", port)
    _port_free("127.0.0.1", port)  # free again
    with pytest.raises(SystemExit, match="the port must be 0-65535, not 99999"):
        _port_free("127.0.0.1", 99999)


def test_a_run_directory_that_cannot_hold_its_sockets_is_said_in_one_line(
    tmp_path: Path,
) -> None:
    long = tmp_path / ("r" * max(1, 104 - len(str(tmp_path / "admin.sock"))))
    with pytest.raises(RunDirError, match=r"too long for its sockets: .* at most 103"):
        RunDir(long).create()
    assert not long.exists()  # refused before anything is made
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(RunDirError, match="is not a directory"):
        RunDir(tmp_path / "link").create()
    (tmp_path / "file").write_text("")
    with pytest.raises(RunDirError, match="cannot be used"):
        RunDir(tmp_path / "file").create()


def test_a_run_directory_of_another_user_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a folder another user made first in a shared /tmp: its sockets would be theirs
    (tmp_path / "run").mkdir()
    monkeypatch.setattr("os.getuid", lambda: (tmp_path / "run").stat().st_uid + 1)
    with pytest.raises(RunDirError, match=r"belongs to another user \(uid \d+\)"):
        RunDir(tmp_path / "run").create()
