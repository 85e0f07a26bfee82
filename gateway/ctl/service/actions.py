"""gatewayctl service install | uninstall | restart | status: writing the file and driving its
manager, and the command line."""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import plistlib
import pwd
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import msgspec

from gateway.ctl.service.launchd import Launchd, launchd_plist
from gateway.ctl.service.manager import (
    Manager,
    ManagerState,
    Run,
    ToolMissing,
    run_tool,
)
from gateway.ctl.service.spec import (
    ManagerKind,
    ServiceError,
    ServiceSpec,
    build_spec,
)
from gateway.ctl.service.systemd import Systemd, systemd_unit
from shared.config import Config
from shared.paths import RunDir


def render(spec: ServiceSpec) -> bytes:
    if spec.kind is ManagerKind.LAUNCHD:
        return plistlib.dumps(launchd_plist(spec), sort_keys=False)
    return systemd_unit(spec).encode()


def manager_for(spec: ServiceSpec, run: Run | None = None) -> Manager:
    # A stop or restart waits for the drain: give the tool that long, and a minute more.
    run = run or functools.partial(run_tool, timeout=spec.stop_timeout_s + 60)
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
