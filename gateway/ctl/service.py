"""gatewayctl service: the gateway as a launchd (macOS) or systemd (Linux) service.

`build_spec` resolves what the service runs from the installing environment; `launchd_plist`
and `systemd_unit` turn that into the file, purely; the actions write it and drive
launchctl or systemctl through a `Manager`; `status` reports what it finds.
`python -m gateway.ctl.service --template launchd|systemd` prints the files under deploy/.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import functools
import math
import os
import plistlib
import pwd
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import msgspec

from shared.config import Config
from shared.paths import APP, RunDir

LABEL = "com.mlx-gateway.gateway"
UNIT = "mlx-gateway.service"
RESTART_DELAY_S = 5  # launchd ThrottleInterval, systemd RestartSec
# Stop timeout beyond server.drain_timeout_s: the drain, then each worker's SIGTERM grace.
STOP_MARGIN_S = 15
MAX_OPEN_FILES = 8192  # launchd's default soft limit is 256: too few for a server
# Carried from the installing environment when set. Not HF_TOKEN: the file is world-readable.
PASSTHROUGH = (
    "MLX_GATEWAY_HOST",
    "MLX_GATEWAY_PORT",
    "MLX_GATEWAY_BLAS",
    "MLX_GATEWAY_CACHE_DIR",
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_HUB_OFFLINE",
)
SYSTEM_RUN_DIR = "/run/mlx-gateway"  # systemd RuntimeDirectory= of a system unit
HOME = "__HOME__"  # placeholders in the templates under deploy/
PYTHON = "/path/to/venv/bin/python"


class ManagerKind(enum.StrEnum):
    LAUNCHD = "launchd"
    SYSTEMD = "systemd"


class ServiceError(Exception):
    """One line for the user; `code` is the exit status (2: usage)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    kind: ManagerKind
    system: bool
    path: Path  # where the plist or unit file goes
    argv: list[str]
    environment: dict[str, str]
    working_dir: str
    log_file: str  # launchd's stdout and stderr; systemd logs to the journal
    stop_timeout_s: int
    user: str | None = None  # LaunchDaemon UserName / system unit User=
    runtime_dir: bool = False  # systemd RuntimeDirectory=mlx-gateway
    uid: int = field(default_factory=os.getuid)

    @property
    def name(self) -> str:
        return LABEL if self.kind is ManagerKind.LAUNCHD else UNIT

    @property
    def scope(self) -> str:
        return "system" if self.system else "user"


def build_spec(
    config: Config,
    config_path: str | None,
    *,
    system: bool = False,
    kind: ManagerKind | None = None,
    env: Mapping[str, str] = os.environ,
    python: str = sys.executable,
) -> ServiceSpec:
    kind = kind or _platform_kind()
    user = env.get("SUDO_USER") if system and env.get("SUDO_USER") != "root" else None
    home = _home_of(user) if user else env.get("HOME") or str(Path.home())
    argv = [python, "-m", "gateway.ctl.cli"]
    argv += ["--config", config_path] if config_path else []
    argv.append("serve")
    path_dirs = [str(Path(python).parent), *env.get("PATH", "").split(os.pathsep)]
    environment = {"PATH": os.pathsep.join(dict.fromkeys(d for d in path_dirs if d[:1] == "/"))}
    if config_path:
        environment["MLX_GATEWAY_CONFIG"] = config_path
    # Pinned, so that the service's run directory (and admin socket) does not depend on
    # the manager's environment (TMPDIR, XDG_RUNTIME_DIR); `status` reads it back.
    runtime_dir = system and kind is ManagerKind.SYSTEMD and not config.server.run_dir
    if runtime_dir:
        run_dir = SYSTEM_RUN_DIR
    elif system and not config.server.run_dir:
        run_dir = f"/tmp/{APP}-{pwd.getpwnam(user).pw_uid if user else 0}"
    else:
        run_dir = str(RunDir(config.server.run_dir).root.absolute())
    environment["MLX_GATEWAY_RUN_DIR"] = run_dir
    environment |= {k: env[k] for k in PASSTHROUGH if env.get(k)}
    environment["PYTHONUNBUFFERED"] = "1"  # log lines reach the log as they happen
    if user and kind is ManagerKind.LAUNCHD:
        environment["HOME"] = home  # launchd sets no HOME for a daemon's UserName
    if kind is ManagerKind.LAUNCHD:
        directory = "/Library/LaunchDaemons" if system else f"{home}/Library/LaunchAgents"
        path = Path(directory) / f"{LABEL}.plist"
        # platformdirs' user_log_dir on macOS, for `home` (tests check that they agree)
        log_dir = f"/Library/Logs/{APP}" if system else f"{home}/Library/Logs/{APP}"
    else:
        config_home = env.get("XDG_CONFIG_HOME") or f"{home}/.config"
        path = Path("/etc/systemd/system" if system else f"{config_home}/systemd/user") / UNIT
        log_dir = ""
    return ServiceSpec(
        kind=kind,
        system=system,
        path=path,
        argv=argv,
        environment=environment,
        working_dir=home,
        log_file=f"{log_dir}/gateway.log" if log_dir else "",
        stop_timeout_s=math.ceil(config.server.drain_timeout_s) + STOP_MARGIN_S,
        user=user,
        runtime_dir=runtime_dir,
    )


def template_spec(kind: ManagerKind) -> ServiceSpec:
    """A user service as install writes it, with placeholders: the files under deploy/."""
    env = {"HOME": HOME, "PATH": "/usr/bin:/bin:/usr/sbin:/sbin"}
    config_path = f"{HOME}/.config/{APP}/config.toml"
    spec = build_spec(Config(), config_path, kind=kind, env=env, python=PYTHON)
    environment = {k: v for k, v in spec.environment.items() if k != "MLX_GATEWAY_RUN_DIR"}
    return dataclasses.replace(spec, environment=environment)


def launchd_plist(spec: ServiceSpec) -> dict[str, Any]:
    plist: dict[str, Any] = {
        "Label": LABEL,
        "ProgramArguments": spec.argv,
        "RunAtLoad": True,
        # Restart after a crash (non-zero exit, or death by a signal), not after a clean
        # exit: `true` would respawn a gateway that was stopped on purpose. Same as
        # systemd's Restart=on-failure.
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": RESTART_DELAY_S,
        # Interactive: exempt from App Nap and background QoS throttling, which would add
        # latency to every token of a server that is mostly idle between requests.
        "ProcessType": "Interactive",
        # launchd sends SIGTERM, waits this long for the drain, then SIGKILLs the job.
        "ExitTimeOut": spec.stop_timeout_s,
        "WorkingDirectory": spec.working_dir,
        "EnvironmentVariables": spec.environment,
        "StandardOutPath": spec.log_file,
        "StandardErrorPath": spec.log_file,
        "SoftResourceLimits": {"NumberOfFiles": MAX_OPEN_FILES},
    }
    if spec.user:
        plist["UserName"] = spec.user
    return plist


def systemd_unit(spec: ServiceSpec) -> str:
    values = [*spec.argv, *spec.environment.values(), spec.working_dir]
    if any("\n" in v for v in values):
        raise ServiceError("a path or environment value contains a newline", code=2)
    lines = [
        "# mlx-gateway; see docs/operations.md, Running as a service.",
        "[Unit]",
        "Description=mlx-gateway: local LLM serving on MLX",
        *(["After=network.target"] if spec.system else []),
        "",
        "[Service]",
        "Type=simple",
        "ExecStart=" + " ".join(_sd_quote(a.replace("$", "$$")) for a in spec.argv),
        f"WorkingDirectory={spec.working_dir.replace('%', '%%')}",
        *(f"Environment={_sd_quote(f'{k}={v}', always=True)}" for k, v in spec.environment.items()),
        *([f"User={spec.user}"] if spec.user else []),
        *(
            ["RuntimeDirectory=mlx-gateway", "RuntimeDirectoryMode=0700"]
            if spec.runtime_dir
            else []
        ),
        "Restart=on-failure",
        f"RestartSec={RESTART_DELAY_S}",
        # SIGTERM to the gateway alone: it drains its workers itself; whatever is left
        # after TimeoutStopSec is SIGKILLed, workers included.
        "KillSignal=SIGTERM",
        "KillMode=mixed",
        f"TimeoutStopSec={spec.stop_timeout_s}",
        f"LimitNOFILE={MAX_OPEN_FILES}",
        "",
        "[Install]",
        f"WantedBy={'multi-user.target' if spec.system else 'default.target'}",
    ]
    return "\n".join(lines) + "\n"


def render(spec: ServiceSpec) -> bytes:
    if spec.kind is ManagerKind.LAUNCHD:
        return plistlib.dumps(launchd_plist(spec), sort_keys=False)
    return systemd_unit(spec).encode()


def _sd_quote(value: str, *, always: bool = False) -> str:
    """One word of a systemd setting: `%` is a specifier, quotes take C-style escapes."""
    value = value.replace("%", "%%")
    if not always and re.fullmatch(r"[\w@%+=:,./-]+", value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


# ---- launchctl / systemctl -------------------------------------------------------------

Run = Callable[[Sequence[str]], subprocess.CompletedProcess[str]]


def _run(argv: Sequence[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise ToolMissing(f"{argv[0]}: not available (not found on PATH)") from None
    except subprocess.TimeoutExpired:
        raise ServiceError(f"{shlex.join(argv)}: no answer after {timeout:.0f} s") from None


class ToolMissing(ServiceError):
    pass


@dataclass(slots=True)
class ManagerState:
    loaded: bool
    running: bool
    state: str
    pid: int | None = None
    last_exit: int | None = None


class Manager(Protocol):
    def start(self, replaced: bool) -> None: ...
    def stop(self) -> None: ...
    def forget(self) -> None: ...
    def restart(self) -> None: ...
    def query(self) -> ManagerState: ...


def _check(argv: list[str], run: Run) -> subprocess.CompletedProcess[str]:
    return _raise_for(argv, run(argv))


def _raise_for(
    argv: list[str], done: subprocess.CompletedProcess[str]
) -> subprocess.CompletedProcess[str]:
    if done.returncode != 0:
        reason = (done.stderr or done.stdout).strip().replace("\n", "; ")
        if "Failed to connect to bus" in reason:
            reason += " (no systemd user session?)"
        raise ServiceError(f"{shlex.join(argv)}: {reason or f'exit status {done.returncode}'}")
    return done


class Launchd:
    def __init__(self, spec: ServiceSpec, run: Run) -> None:
        self.spec, self.run = spec, run
        self.domain = "system" if spec.system else f"gui/{spec.uid}"
        self.target = f"{self.domain}/{LABEL}"

    def start(self, replaced: bool) -> None:
        if self.query().loaded:
            if not replaced:
                _check(["launchctl", "kickstart", self.target], self.run)  # no-op if running
                return
            _check(["launchctl", "bootout", self.target], self.run)
        _check(["launchctl", "enable", self.target], self.run)  # undo a `launchctl disable`
        _check(["launchctl", "bootstrap", self.domain, str(self.spec.path)], self.run)

    def stop(self) -> None:
        if self.query().loaded:
            _check(["launchctl", "bootout", self.target], self.run)

    def forget(self) -> None:
        pass

    def restart(self) -> None:
        if not self.query().loaded:
            raise ServiceError(f"{self.target} is not loaded: `gatewayctl service install`")
        _check(["launchctl", "kickstart", "-k", self.target], self.run)

    def query(self) -> ManagerState:
        argv = ["launchctl", "print", self.target]
        done = self.run(argv)
        if done.returncode != 0 and "Could not find service" in done.stdout + done.stderr:
            return ManagerState(loaded=False, running=False, state="not loaded")
        _raise_for(argv, done)
        fields = dict(re.findall(r"^\t([a-z][a-z ]*) = (.*)$", done.stdout, re.MULTILINE))
        state = fields.get("state", "unknown")
        return ManagerState(
            loaded=True,
            running=state == "running",
            state=state,
            pid=_int(fields.get("pid")),
            last_exit=_int(fields.get("last exit code")),
        )


class Systemd:
    def __init__(self, spec: ServiceSpec, run: Run) -> None:
        self.run = run
        self.systemctl = ["systemctl"] if spec.system else ["systemctl", "--user"]

    def _do(self, *args: str) -> subprocess.CompletedProcess[str]:
        return _check([*self.systemctl, *args], self.run)

    def start(self, replaced: bool) -> None:
        self._do("daemon-reload")
        self._do("enable", "--now", UNIT)
        if replaced:
            self._do("try-restart", UNIT)  # a running one picks up the new file

    def stop(self) -> None:
        self._do("disable", "--now", UNIT)

    def forget(self) -> None:
        self._do("daemon-reload")

    def restart(self) -> None:
        self._do("restart", UNIT)

    def query(self) -> ManagerState:
        keys = "LoadState,UnitFileState,ActiveState,SubState,MainPID,ExecMainStatus"
        done = self._do("show", "-p", keys, UNIT)
        props = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
        active = props.get("ActiveState", "unknown")
        enabled = props.get("UnitFileState") or "-"
        return ManagerState(
            loaded=props.get("LoadState") == "loaded",
            running=active in ("active", "reloading"),
            state=f"{active} ({props.get('SubState', '?')}), {enabled}",
            pid=_int(props.get("MainPID")) or None,
            last_exit=_int(props.get("ExecMainStatus")),
        )


def manager_for(spec: ServiceSpec, run: Run | None = None) -> Manager:
    # A stop or restart waits for the drain: give the tool that long, and a minute more.
    run = run or functools.partial(_run, timeout=spec.stop_timeout_s + 60)
    return Launchd(spec, run) if spec.kind is ManagerKind.LAUNCHD else Systemd(spec, run)


# ---- actions ---------------------------------------------------------------------------


def check_root(spec: ServiceSpec, euid: int, env: Mapping[str, str] = os.environ) -> None:
    """Before writing: a system service needs root; a user service must not be root's."""
    if spec.system and euid != 0:
        where = spec.path.parent
        raise ServiceError(f"--system writes {where} and needs root: run it with sudo", code=2)
    if not spec.system and euid == 0 and env.get("SUDO_USER"):
        raise ServiceError("a user service under sudo would be root's: drop sudo, or --system", 2)


def install(
    spec: ServiceSpec, *, start: bool = True, force: bool = False, run: Run | None = None
) -> int:
    content = render(spec)
    existing = spec.path.read_bytes() if spec.path.exists() else None
    if existing is not None and existing != content and not force:
        raise ServiceError(
            f"{spec.path} exists and differs; compare: `gatewayctl [same options] service "
            f"install{_sys(spec)} --print | diff {spec.path} -`; replace it with --force"
        )
    if existing != content:
        _write(spec, content)
        print(f"wrote {spec.path}")
    else:
        print(f"{spec.path} is up to date")
    if spec.log_file:
        print(f"logs: {spec.log_file}")
    if not start:
        print(f"not started (--no-start); to start it: gatewayctl service install{_sys(spec)}")
        return 0
    manager_for(spec, run).start(replaced=existing is not None and existing != content)
    print(f"started {spec.name} ({spec.kind} {spec.scope} service)")
    if spec.kind is ManagerKind.SYSTEMD and not spec.system:
        user = pwd.getpwuid(spec.uid).pw_name
        if not Path(f"/var/lib/systemd/linger/{user}").exists():
            print(f"note: it stops at logout unless lingering is on: loginctl enable-linger {user}")
    return 0


def uninstall(spec: ServiceSpec, *, force: bool = False, run: Run | None = None) -> int:
    if not spec.path.exists():
        raise ServiceError(f"{spec.name} is not installed (no {spec.path})")
    manager = manager_for(spec, run)
    try:
        manager.stop()
    except ToolMissing as exc:  # no manager: nothing can be running under it
        print(f"note: {exc}; nothing to stop", file=sys.stderr)
    except ServiceError as exc:
        if not force:
            raise
        print(f"note: {exc}; removing the file anyway (--force)", file=sys.stderr)
    spec.path.unlink()
    print(f"removed {spec.path}")
    with contextlib.suppress(ToolMissing):
        manager.forget()
    return 0


def restart(spec: ServiceSpec, *, run: Run | None = None) -> int:
    if not spec.path.exists():
        raise ServiceError(f"{spec.name} is not installed (no {spec.path})")
    manager_for(spec, run).restart()
    print(f"restarted {spec.name}")
    return 0


class ServiceStatus(msgspec.Struct):
    manager: str
    scope: str
    name: str
    path: str
    installed: bool
    loaded: bool | None  # None: the manager could not be asked (manager_error says why)
    running: bool | None
    state: str | None
    pid: int | None
    last_exit: int | None
    manager_error: str | None
    admin_socket: str
    answering: bool
    gateway: dict[str, Any] | None  # its GET /status
    gateway_error: str | None
    ok: bool  # installed, and running (per the manager, else per the admin socket)


def status(spec: ServiceSpec, config: Config, *, run: Run | None = None) -> ServiceStatus:
    installed = spec.path.exists()
    found: ManagerState | None = None
    error = None
    try:
        found = manager_for(spec, run).query()
    except ServiceError as exc:
        error = str(exc)
    run_dir = _installed_env(spec).get("MLX_GATEWAY_RUN_DIR") or config.server.run_dir
    socket = RunDir(run_dir).admin_socket
    gateway, gateway_error = _probe(socket)
    running = found.running if found else None
    return ServiceStatus(
        manager=str(spec.kind),
        scope=spec.scope,
        name=spec.name,
        path=str(spec.path),
        installed=installed,
        loaded=found.loaded if found else None,
        running=running,
        state=found.state if found else None,
        pid=found.pid if found else None,
        last_exit=found.last_exit if found else None,
        manager_error=error,
        admin_socket=str(socket),
        answering=gateway is not None,
        gateway=gateway,
        gateway_error=gateway_error,
        ok=installed and (running if running is not None else gateway is not None),
    )


def format_status(s: ServiceStatus) -> str:
    where = s.path if s.installed else f"not installed (no {s.path})"
    if s.manager_error:
        manager = s.manager_error
    elif s.loaded:
        manager = f"loaded, {s.state}" + (f", pid {s.pid}" if s.pid else "")
        manager += f", last exit status {s.last_exit}" if s.last_exit else ""
    else:
        manager = f"not loaded ({s.state})"
    if s.gateway:
        gateway = f"answering: mlx-gateway {s.gateway.get('version')} (pid {s.gateway.get('pid')})"
    else:
        gateway = f"not answering: {s.gateway_error}"
    return "\n".join(
        [
            f"service: {s.name} ({s.manager} {s.scope} service)",
            f"file:    {where}",
            f"manager: {manager}",
            f"gateway: {gateway}",
        ]
    )


def _probe(socket: Path) -> tuple[dict[str, Any] | None, str | None]:
    if not socket.exists():
        return None, f"no admin socket at {socket}"
    transport = httpx.HTTPTransport(uds=str(socket))
    try:
        with httpx.Client(transport=transport, base_url="http://gateway", timeout=3) as client:
            response = client.get("/status")
            response.raise_for_status()
            return response.json(), None
    except (httpx.HTTPError, ValueError) as exc:
        return None, f"no answer on {socket}: {exc}"


def _installed_env(spec: ServiceSpec) -> dict[str, str]:
    """The environment the installed file gives the service (empty when it cannot tell)."""
    try:
        if spec.kind is ManagerKind.LAUNCHD:
            return dict(plistlib.loads(spec.path.read_bytes()).get("EnvironmentVariables", {}))
        env: dict[str, str] = {}
        for line in spec.path.read_text().splitlines():
            if line.startswith("Environment="):
                for word in shlex.split(line.removeprefix("Environment=")):
                    key, _, value = word.replace("%%", "%").partition("=")
                    env[key] = value
        return env
    except (OSError, ValueError, plistlib.InvalidFileException, AttributeError):
        return {}


def _write(spec: ServiceSpec, content: bytes) -> None:
    spec.path.parent.mkdir(parents=True, exist_ok=True)
    if spec.log_file:
        log_dir = Path(spec.log_file).parent
        log_dir.mkdir(parents=True, exist_ok=True)  # launchd does not create it
        if spec.user:
            entry = pwd.getpwnam(spec.user)
            os.chown(log_dir, entry.pw_uid, entry.pw_gid)
    staging = spec.path.with_name(f".{spec.path.name}.new")
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    with os.fdopen(fd, "wb") as out:
        os.fchmod(out.fileno(), 0o644)  # whatever the umask
        out.write(content)
    os.replace(staging, spec.path)


def _platform_kind() -> ManagerKind:
    if sys.platform == "darwin":
        return ManagerKind.LAUNCHD
    if sys.platform.startswith("linux"):
        return ManagerKind.SYSTEMD
    raise ServiceError(f"no service manager support on {sys.platform}", code=2)


def _home_of(user: str) -> str:
    try:
        return pwd.getpwnam(user).pw_dir
    except KeyError:
        raise ServiceError(f"SUDO_USER={user!r} is not a user of this machine", code=2) from None


def _int(text: str | None) -> int | None:
    return int(text) if text and re.fullmatch(r"-?\d+", text.strip()) else None


def _sys(spec: ServiceSpec) -> str:
    return " --system" if spec.system else ""


# ---- gatewayctl service ----------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)
    install_ = actions.add_parser("install", help="write the service file, load and start it")
    install_.add_argument("--no-start", dest="start", action="store_false", help="write only")
    install_.add_argument("--force", action="store_true", help="replace a different file")
    install_.add_argument("--print", dest="print_only", action="store_true", help="print it")
    uninstall_ = actions.add_parser("uninstall", help="stop and unload it, remove the file")
    uninstall_.add_argument("--force", action="store_true", help="remove it if the stop fails")
    status_ = actions.add_parser("status", help="what the service manager and gateway say")
    status_.add_argument("--json", action="store_true")
    actions.add_parser("restart", help="restart the service (the gateway drains first)")
    for action in actions.choices.values():
        action.add_argument(
            "--system", action="store_true", help="LaunchDaemon / system unit (root)"
        )


def main(args: argparse.Namespace, config: Config) -> int:
    """`gatewayctl [--config F] [--run-dir D] service ACTION ...`, with the loaded config."""
    config_path = args.config or os.environ.get("MLX_GATEWAY_CONFIG")
    config_path = str(Path(config_path).expanduser().absolute()) if config_path else None
    try:
        spec = build_spec(config, config_path, system=args.system)
        if args.action == "status":
            if not args.system and not spec.path.exists():
                system = build_spec(config, config_path, system=True)
                spec = system if system.path.exists() else spec  # report what is there
            found = status(spec, config)
            if args.json:
                print(msgspec.json.format(msgspec.json.encode(found)).decode())
            else:
                print(format_status(found))
            return 0 if found.ok else 1
        if args.action == "install" and args.print_only:
            sys.stdout.write(render(spec).decode())
            return 0
        check_root(spec, os.geteuid())
        if args.action == "install":
            return install(spec, start=args.start, force=args.force)
        if args.action == "uninstall":
            return uninstall(spec, force=args.force)
        return restart(spec)
    except ServiceError as exc:
        print(f"gatewayctl: {exc}", file=sys.stderr)
        return exc.code
    except OSError as exc:  # writing or removing the file, creating the log directory
        print(f"gatewayctl: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    cli = argparse.ArgumentParser(prog="python -m gateway.ctl.service")
    cli.add_argument("--template", choices=[k.value for k in ManagerKind], required=True)
    sys.stdout.buffer.write(render(template_spec(ManagerKind(cli.parse_args().template))))
