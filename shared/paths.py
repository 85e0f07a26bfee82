"""Where state, logs and sockets live: one 0700 run directory per user."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import platformdirs

APP = "mlx-gateway"


def default_run_dir() -> Path:
    """Short on purpose: ipc:// socket paths must fit in 104 bytes on macOS."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and len(runtime) < 48:
        return Path(runtime) / APP
    return Path(tempfile.gettempdir()) / f"{APP}-{os.getuid()}"


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The user's cache for this project (MLX_GATEWAY_CACHE_DIR in `environ`, default the
    process's environment, else the platform's user cache)."""
    override = (os.environ if environ is None else environ).get("MLX_GATEWAY_CACHE_DIR")
    return Path(override) if override else Path(platformdirs.user_cache_dir(APP))


class RunDir:
    """The layout of a run directory."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root) if root else default_run_dir()

    def create(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.root, 0o700)
        self.logs.mkdir(exist_ok=True, mode=0o700)

    @property
    def requests_ipc(self) -> str:
        return f"ipc://{self.root / 'in.sock'}"

    @property
    def outputs_ipc(self) -> str:
        return f"ipc://{self.root / 'out.sock'}"

    @property
    def admin_socket(self) -> Path:
        return self.root / "admin.sock"

    @property
    def pid_file(self) -> Path:
        return self.root / "gateway.pid"

    @property
    def workers_file(self) -> Path:
        """Pids of the workers this gateway spawned, for cleanup after a crash."""
        return self.root / "workers.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def worker_log(self, model: str) -> Path:
        return self.logs / f"worker-{model}.log"
