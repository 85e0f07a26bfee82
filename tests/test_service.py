"""gatewayctl service: the launchd plist and systemd unit built from the config, the real CLI
on this machine (systemd, user scope, --no-start), and the launchctl/systemctl command
sequences through an injected runner (neither tool is ever run against a real manager)."""

from __future__ import annotations

import json
import os
import plistlib
import pwd
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec
import platformdirs.macos
import pytest

from gateway.ctl import service
from gateway.ctl.service import LABEL, UNIT, ManagerKind, ServiceError, ServiceSpec
from shared.config import Config, ServerConfig

ROOT = Path(__file__).resolve().parent.parent
PYTHON = "/opt/venv/bin/python"


def _config(tmp_path: Path, drain: float = 20.0) -> Config:
    return Config(server=ServerConfig(run_dir=str(tmp_path / "run"), drain_timeout_s=drain))


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin:relative", **extra}


def _other_user() -> pwd.struct_passwd:
    return next(p for p in pwd.getpwall() if p.pw_uid != 0)


def _unit(text: str) -> dict[str, list[tuple[str, str]]]:
    """Sections of a unit file as (key, value) lists, in order; comments skipped."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not a key=value line: {line!r}"
        current.append((key, value))
    return sections


def _words(value: str) -> list[str]:
    return [w.replace("%%", "%") for w in shlex.split(value)]


# ---- the files -------------------------------------------------------------------------


def test_launch_agent_plist(tmp_path: Path) -> None:
    env = _env(
        tmp_path, HF_HOME="/data/hf", HF_HUB_OFFLINE="1", HF_TOKEN="hf_x", MLX_GATEWAY_FAULTS="{}"
    ) | {"XDG_CONFIG_HOME": "/data/xdg"}  # where the shell's gatewayctl keeps the keys
    spec = service.build_spec(
        _config(tmp_path), "/etc/gw.toml", kind=ManagerKind.LAUNCHD, env=env, python=PYTHON
    )
    assert spec.path == tmp_path / "Library/LaunchAgents/com.mlx-gateway.gateway.plist"
    plist = plistlib.loads(service.render(spec))
    assert plist["Label"] == LABEL
    assert plist["ProgramArguments"] == [
        PYTHON,
        "-m",
        "gateway.ctl.cli",
        "--config",
        "/etc/gw.toml",
        "serve",
    ]
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}
    assert plist["ProcessType"] == "Interactive"
    assert plist["ThrottleInterval"] == service.RESTART_DELAY_S
    assert plist["ExitTimeOut"] == 20 + 15
    log = f"{tmp_path}/Library/Logs/mlx-gateway/gateway.log"
    assert plist["StandardOutPath"] == plist["StandardErrorPath"] == log
    assert plist["WorkingDirectory"] == str(tmp_path)
    assert "UserName" not in plist
    environment = plist["EnvironmentVariables"]
    assert environment["PATH"] == "/opt/venv/bin:/usr/bin:/bin"  # no relative entries
    assert environment["MLX_GATEWAY_CONFIG"] == "/etc/gw.toml"
    assert environment["MLX_GATEWAY_RUN_DIR"] == str(tmp_path / "run")
    assert environment["HF_HOME"] == "/data/hf"
    assert environment["HF_HUB_OFFLINE"] == "1"
    assert environment["XDG_CONFIG_HOME"] == "/data/xdg"
    assert "HF_TOKEN" not in environment  # the file is world-readable
    assert "MLX_GATEWAY_FAULTS" not in environment
    assert "HOME" not in environment  # launchd gives an agent its user's HOME


def test_launch_daemon_plist(tmp_path: Path) -> None:
    user = _other_user()
    config = Config(server=ServerConfig(drain_timeout_s=7.5))
    env = _env(tmp_path, SUDO_USER=user.pw_name)
    spec = service.build_spec(
        config, None, system=True, kind=ManagerKind.LAUNCHD, env=env, python=PYTHON
    )
    assert spec.path == Path("/Library/LaunchDaemons/com.mlx-gateway.gateway.plist")
    plist = plistlib.loads(service.render(spec))
    assert plist["ProgramArguments"] == [PYTHON, "-m", "gateway.ctl.cli", "serve"]  # no --config
    assert plist["UserName"] == user.pw_name
    assert plist["ExitTimeOut"] == 8 + 15
    assert plist["StandardOutPath"] == "/Library/Logs/mlx-gateway/gateway.log"
    assert plist["WorkingDirectory"] == user.pw_dir
    environment = plist["EnvironmentVariables"]
    assert environment["HOME"] == user.pw_dir
    assert "MLX_GATEWAY_CONFIG" not in environment
    assert environment["MLX_GATEWAY_RUN_DIR"] == f"/tmp/mlx-gateway-{user.pw_uid}"


def test_launchd_log_dir_is_platformdirs_user_log_dir() -> None:
    mac = platformdirs.macos.MacOS("mlx-gateway").user_log_dir
    assert mac == f"{Path.home()}/Library/Logs/mlx-gateway"


def test_systemd_user_unit(tmp_path: Path) -> None:
    config_path = "/etc/my gw/100%.toml"  # a space and a specifier character
    env = _env(tmp_path, XDG_CONFIG_HOME=str(tmp_path / "xdg"), HF_HOME='/hf "home"')
    spec = service.build_spec(
        _config(tmp_path, drain=30), config_path, kind=ManagerKind.SYSTEMD, env=env, python=PYTHON
    )
    assert spec.path == tmp_path / "xdg/systemd/user" / UNIT
    text = service.systemd_unit(spec)
    sections = _unit(text)
    assert list(sections) == ["Unit", "Service", "Install"]
    unit = dict(sections["Unit"])
    assert unit["Description"].startswith("mlx-gateway")
    assert "After" not in unit  # no network.target in a user manager
    svc = sections["Service"]
    settings = dict(svc)
    assert settings["Type"] == "simple"
    assert _words(settings["ExecStart"]) == [
        PYTHON,
        "-m",
        "gateway.ctl.cli",
        "--config",
        config_path,
        "serve",
    ]
    assert "100%%.toml" in settings["ExecStart"]
    assert settings["WorkingDirectory"] == str(tmp_path)
    assert settings["Restart"] == "on-failure"
    assert settings["RestartSec"] == str(service.RESTART_DELAY_S)
    assert settings["KillSignal"] == "SIGTERM"
    assert settings["KillMode"] == "mixed"
    assert settings["TimeoutStopSec"] == "45"
    assert "User" not in settings
    assert "RuntimeDirectory" not in settings
    environment = {}
    for key, value in svc:
        if key == "Environment":
            assert value.startswith('"') and value.endswith('"')
            (word,) = _words(value)
            name, _, val = word.partition("=")
            environment[name] = val
    assert environment == {
        "PATH": "/opt/venv/bin:/usr/bin:/bin",
        "MLX_GATEWAY_CONFIG": config_path,
        "MLX_GATEWAY_RUN_DIR": str(tmp_path / "run"),
        "HF_HOME": '/hf "home"',
        "XDG_CONFIG_HOME": str(tmp_path / "xdg"),  # the keys the shell's gatewayctl made
        "PYTHONUNBUFFERED": "1",
    }
    assert sections["Install"] == [("WantedBy", "default.target")]


def test_systemd_system_unit(tmp_path: Path) -> None:
    user = _other_user()
    env = _env(tmp_path, SUDO_USER=user.pw_name)
    spec = service.build_spec(
        Config(), None, system=True, kind=ManagerKind.SYSTEMD, env=env, python=PYTHON
    )
    assert spec.path == Path("/etc/systemd/system") / UNIT
    sections = _unit(service.systemd_unit(spec))
    settings = dict(sections["Service"])
    assert dict(sections["Unit"])["After"] == "network.target"
    assert settings["User"] == user.pw_name
    assert settings["RuntimeDirectory"] == "mlx-gateway"
    assert '"MLX_GATEWAY_RUN_DIR=/run/mlx-gateway"' in [v for k, v in sections["Service"]]
    assert _words(settings["ExecStart"]) == [PYTHON, "-m", "gateway.ctl.cli", "serve"]
    assert sections["Install"] == [("WantedBy", "multi-user.target")]


def test_root_checks(tmp_path: Path) -> None:
    system = service.build_spec(Config(), None, system=True, env=_env(tmp_path))
    with pytest.raises(ServiceError, match="needs root: run it with sudo") as error:
        service.check_root(system, euid=1000, env={})
    assert error.value.code == 2
    service.check_root(system, euid=0, env={})
    user = service.build_spec(Config(), None, env=_env(tmp_path))
    service.check_root(user, euid=1000, env={})
    with pytest.raises(ServiceError, match="drop sudo"):
        service.check_root(user, euid=0, env={"SUDO_USER": "alice"})


@pytest.mark.parametrize(
    ("kind", "path"),
    [
        (ManagerKind.LAUNCHD, "deploy/launchd/com.mlx-gateway.gateway.plist"),
        (ManagerKind.SYSTEMD, "deploy/systemd/mlx-gateway.service"),
    ],
)
def test_checked_in_templates_match_the_generator(kind: ManagerKind, path: str) -> None:
    generated = service.render(service.template_spec(kind))
    assert (ROOT / path).read_bytes() == generated, (
        f"{path} is stale: python -m gateway.ctl.service --template {kind} > {path}"
    )
    assert b"__HOME__" in generated and b"/path/to/" in generated


# ---- gatewayctl service, for real, on this machine -------------------------------------


def _gatewayctl(
    tmp_path: Path, *args: str, run_dir: Path | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    """The real CLI with HOME and XDG_CONFIG_HOME in tmp_path and no systemctl on PATH."""
    empty = tmp_path / "empty-path"
    empty.mkdir(exist_ok=True)
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("MLX_GATEWAY_", "HF_")) and k != "SUDO_USER"
    }
    base |= {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    base |= {"PATH": str(empty), **env}
    argv = [sys.executable, "-m", "gateway.ctl.cli", "--run-dir", str(run_dir or tmp_path / "run")]
    return subprocess.run(
        [*argv, "service", *args], env=base, capture_output=True, text=True, timeout=60
    )


def _unit_path(tmp_path: Path) -> Path:
    return tmp_path / "xdg/systemd/user" / UNIT


def test_install_status_uninstall(tmp_path: Path) -> None:
    done = _gatewayctl(tmp_path, "install", "--no-start")
    assert done.returncode == 0, done.stderr
    path = _unit_path(tmp_path)
    assert path.stat().st_mode & 0o777 == 0o644
    settings = dict(_unit(path.read_text())["Service"])
    assert _words(settings["ExecStart"]) == [sys.executable, "-m", "gateway.ctl.cli", "serve"]
    assert f"wrote {path}" in done.stdout

    done = _gatewayctl(tmp_path, "status", "--json")
    assert done.returncode == 1, done.stderr
    found = json.loads(done.stdout)
    assert found["manager"] == "systemd" and found["scope"] == "user"
    assert found["installed"] is True and found["path"] == str(path)
    assert found["running"] is not True and found["ok"] is False
    assert found["manager_error"] == "systemctl: not available (not found on PATH)"
    assert found["answering"] is False and found["gateway"] is None
    assert found["admin_socket"] == str(tmp_path / "run/admin.sock")
    assert "no admin socket" in found["gateway_error"]

    done = _gatewayctl(tmp_path, "status")
    assert done.returncode == 1
    assert "systemctl: not available" in done.stdout and "not answering" in done.stdout

    done = _gatewayctl(tmp_path, "uninstall")
    assert done.returncode == 0, done.stderr
    assert not path.exists()
    assert "nothing to stop" in done.stderr

    found = json.loads(_gatewayctl(tmp_path, "status", "--json").stdout)
    assert found["installed"] is False
    done = _gatewayctl(tmp_path, "uninstall")
    assert done.returncode == 1 and "is not installed" in done.stderr


def test_status_finds_a_real_gateway_on_its_admin_socket(tmp_path: Path) -> None:
    """The service's run directory, pinned in the unit file, leads status to the gateway."""
    from tests.gateway_proc import running_gateway

    demo = {"name": "demo", "source": "builtin:demo", "preload": False}
    with running_gateway([demo], env={"MLX_GATEWAY_CACHE_DIR": str(tmp_path)}) as gw:
        done = _gatewayctl(tmp_path, "install", "--no-start", run_dir=gw.run_dir)
        assert done.returncode == 0, done.stderr
        # status without --run-dir: the run directory comes from the installed unit
        done = _gatewayctl(tmp_path, "status", "--json", run_dir=tmp_path / "elsewhere")
        found = json.loads(done.stdout)
        assert found["admin_socket"] == str(gw.run_dir / "admin.sock")
        assert found["answering"] is True and found["gateway_error"] is None
        assert found["gateway"]["models"] == {"demo": "unloaded"}
        assert found["running"] is None  # systemctl is not on PATH: unknown, and said so
        assert found["ok"] is True and done.returncode == 0
        text = _gatewayctl(tmp_path, "status", run_dir=gw.run_dir).stdout
        assert "gateway: answering: mlx-gateway" in text


def test_install_refuses_to_overwrite_a_different_file(tmp_path: Path) -> None:
    assert _gatewayctl(tmp_path, "install", "--no-start").returncode == 0
    path = _unit_path(tmp_path)
    before = path.read_bytes()
    done = _gatewayctl(tmp_path, "install", "--no-start", MLX_GATEWAY_PORT="9001")
    assert done.returncode == 1
    assert "exists and differs" in done.stderr and "--force" in done.stderr
    assert "diff" in done.stderr
    assert path.read_bytes() == before

    done = _gatewayctl(tmp_path, "install", "--no-start", "--force", MLX_GATEWAY_PORT="9001")
    assert done.returncode == 0, done.stderr
    assert '"MLX_GATEWAY_PORT=9001"' in path.read_text()

    done = _gatewayctl(tmp_path, "install", "--no-start", MLX_GATEWAY_PORT="9001")
    assert done.returncode == 0 and "up to date" in done.stdout


def test_install_print_writes_nothing(tmp_path: Path) -> None:
    done = _gatewayctl(tmp_path, "install", "--print")
    assert done.returncode == 0, done.stderr
    assert "[Service]" in done.stdout and "ExecStart=" in done.stdout
    written = [p for p in tmp_path.rglob("*") if p.name != "empty-path"]
    assert written == []


def test_missing_systemctl_is_one_clear_line(tmp_path: Path) -> None:
    done = _gatewayctl(tmp_path, "install")
    assert done.returncode == 1
    assert done.stderr == "gatewayctl: systemctl: not available (not found on PATH)\n"
    done = _gatewayctl(tmp_path, "restart")
    assert done.returncode == 1
    assert done.stderr == "gatewayctl: systemctl: not available (not found on PATH)\n"


def test_usage_error_exits_2(tmp_path: Path) -> None:
    done = _gatewayctl(tmp_path, "install", "--bogus")
    assert done.returncode == 2 and "usage:" in done.stderr


# ---- the command sequences, through an injected runner ---------------------------------


class FakeTool:
    """Records each command; answers from `replies` by the command's first words."""

    def __init__(self, replies: dict[tuple[str, ...], tuple[int, str, str]]) -> None:
        self.replies, self.calls = replies, []

    def __call__(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        self.calls.append(list(argv))
        for n in range(len(argv), 0, -1):
            if tuple(argv[:n]) in self.replies:
                code, out, err = self.replies[tuple(argv[:n])]
                return subprocess.CompletedProcess(list(argv), code, out, err)
        return subprocess.CompletedProcess(list(argv), 0, "", "")


def _spec(tmp_path: Path, kind: ManagerKind) -> ServiceSpec:
    return service.build_spec(_config(tmp_path), None, kind=kind, env=_env(tmp_path))


NOT_LOADED = (113, "", 'Could not find service "com.mlx-gateway.gateway" in domain for port\n')
PRINT = """gui/501/com.mlx-gateway.gateway = {
\tactive count = 1
\tpath = /Users/me/Library/LaunchAgents/com.mlx-gateway.gateway.plist
\tstate = running
\tpid = 4242
\tlast exit code = 1
\tenvironment = {
\t\tstate = nested
\t}
}
"""


def test_launchd_install_bootstraps_then_restart_kickstarts(tmp_path: Path) -> None:
    spec = _spec(tmp_path, ManagerKind.LAUNCHD)
    tool = FakeTool({("launchctl", "print"): NOT_LOADED})
    assert service.install(spec, run=tool) == 0
    target = f"gui/{os.getuid()}/{LABEL}"
    assert tool.calls == [
        ["launchctl", "print", target],
        ["launchctl", "enable", target],
        ["launchctl", "bootstrap", f"gui/{os.getuid()}", str(spec.path)],
    ]
    assert plistlib.loads(spec.path.read_bytes())["Label"] == LABEL
    assert (tmp_path / "Library/Logs/mlx-gateway").is_dir()

    loaded = FakeTool({("launchctl", "print"): (0, PRINT, "")})
    assert service.restart(spec, run=loaded) == 0
    assert loaded.calls[-1] == ["launchctl", "kickstart", "-k", target]
    state = service.Launchd(spec, loaded).query()
    assert (state.loaded, state.running, state.pid, state.last_exit) == (True, True, 4242, 1)

    replaced = service.build_spec(
        _config(tmp_path, drain=60), None, kind=ManagerKind.LAUNCHD, env=_env(tmp_path)
    )
    loaded.calls.clear()
    assert service.install(replaced, force=True, run=loaded) == 0
    assert [c[1] for c in loaded.calls] == ["print", "bootout", "enable", "bootstrap"]

    loaded.calls.clear()
    assert service.uninstall(replaced, run=loaded) == 0
    assert loaded.calls[-1] == ["launchctl", "bootout", target]
    assert not spec.path.exists()


def test_systemd_install_status_and_failure(tmp_path: Path) -> None:
    spec = _spec(tmp_path, ManagerKind.SYSTEMD)
    show = "LoadState=loaded\nUnitFileState=enabled\nActiveState=active\nSubState=running\n"
    tool = FakeTool(
        {("systemctl", "--user", "show"): (0, show + "MainPID=77\nExecMainStatus=0\n", "")}
    )
    assert service.install(spec, run=tool) == 0
    assert tool.calls == [
        ["systemctl", "--user", "daemon-reload"],
        ["systemctl", "--user", "enable", "--now", UNIT],
    ]
    found = service.status(spec, _config(tmp_path), run=tool)
    assert (found.installed, found.loaded, found.running, found.pid) == (True, True, True, 77)
    assert found.state == "active (running), enabled"
    assert found.ok is True and found.answering is False  # what the manager says, and the socket
    assert "pid 77" in service.format_status(found)
    assert msgspec.json.decode(msgspec.json.encode(found))["manager"] == "systemd"

    failing = FakeTool({("systemctl", "--user", "restart"): (1, "", "Unit not found.\n")})
    with pytest.raises(ServiceError) as error:
        service.restart(spec, run=failing)
    assert str(error.value) == f"systemctl --user restart {UNIT}: Unit not found."

    stuck = FakeTool({("systemctl", "--user", "disable"): (1, "", "Access denied\n")})
    with pytest.raises(ServiceError, match="Access denied"):
        service.uninstall(spec, run=stuck)
    assert spec.path.exists()  # kept: the service may still be running
    assert service.uninstall(spec, force=True, run=stuck) == 0
    assert not spec.path.exists()
