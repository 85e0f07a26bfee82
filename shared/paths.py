"""Where state, logs and sockets live: one 0700 run directory per user."""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

import platformdirs

APP = "mlx-gateway"


# the longest socket path this side of sockaddr_un's limit: 104 bytes with its NUL on macOS
# (108 on Linux), where a longer one fails only once the server binds it
SOCKET_PATH_MAX = 103
SOCKETS = ("in.sock", "out.sock", "admin.sock")


class RunDirError(Exception):
    """The run directory cannot serve: the message says why, in one line."""


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
        """Made (0700) if it is not there; RunDirError if its sockets' paths are too long,
        or if it is not this user's own directory (a link, or another user's folder in a
        shared /tmp: its sockets would be theirs to take)."""
        root = self.root
        longest = max(len(os.fsencode(root / name)) for name in SOCKETS)
        if longest > SOCKET_PATH_MAX:
            raise RunDirError(
                f"the run directory {root} is too long for its sockets: their paths would be "
                f"{longest} bytes, and a socket's path holds at most {SOCKET_PATH_MAX}; give "
                "a shorter one (server.run_dir, --run-dir)"
            )
        try:
            root.mkdir(parents=True, exist_ok=True, mode=0o700)
            found = os.lstat(root)
            if stat.S_ISLNK(found.st_mode) or not stat.S_ISDIR(found.st_mode):
                raise RunDirError(f"the run directory {root} is not a directory (a link?)")
            if found.st_uid != os.getuid():
                raise RunDirError(
                    f"the run directory {root} belongs to another user (uid {found.st_uid}); "
                    "remove it, or give another one (server.run_dir, --run-dir)"
                )
            os.chmod(root, 0o700)
            self.logs.mkdir(exist_ok=True, mode=0o700)
        except OSError as exc:
            raise RunDirError(f"the run directory {root} cannot be used: {exc}") from None

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
