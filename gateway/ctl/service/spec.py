"""What the service runs, resolved from the installing environment (or the templates' placeholders
for the files under deploy/), and where its file goes."""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import pwd
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

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
    # where the keys file, the cluster's keys and the caches are: the service must find
    # those the installing shell's gatewayctl wrote
    "XDG_CONFIG_HOME",
    "XDG_CACHE_HOME",
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
    kind = kind or platform_kind()
    user = env.get("SUDO_USER") if system and env.get("SUDO_USER") != "root" else None
    home = home_of(user) if user else env.get("HOME") or str(Path.home())
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


def platform_kind() -> ManagerKind:
    if sys.platform == "darwin":
        return ManagerKind.LAUNCHD
    if sys.platform.startswith("linux"):
        return ManagerKind.SYSTEMD
    raise ServiceError(f"no service manager support on {sys.platform}", code=2)


def home_of(user: str) -> str:
    try:
        return pwd.getpwnam(user).pw_dir
    except KeyError:
        raise ServiceError(f"SUDO_USER={user!r} is not a user of this machine", code=2) from None
