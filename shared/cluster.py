"""Keys for workers on other machines (ZeroMQ CURVE, Curve25519): the gateway's key pair,
a worker's key pair, and the gateway's list of the workers allowed to dial in, managed with
`gatewayctl workers add | remove | list` and read again by a running gateway when it changes.

Each key pair lives in its own 0600 file in a 0700 folder (server.cluster_dir, by default
<user config dir>/cluster); public keys are 40-character Z85 text, safe to copy around.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import platformdirs
import zmq
from zmq.utils import z85

GATEWAY_KEY = "gateway.key"
WORKER_KEY = "worker.key"
ALLOWED_FILE = "workers.json"
Z85_CHARS = frozenset(z85.Z85CHARS.decode())
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class ClusterError(Exception):
    pass


class KeyPair(msgspec.Struct, forbid_unknown_fields=True):
    public: str
    secret: str


class AllowedWorker(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: str
    public_key: str
    added_at: float = 0.0


class AllowedFile(msgspec.Struct, forbid_unknown_fields=True):
    workers: list[AllowedWorker] = []


def cluster_dir(configured: str | None) -> Path:
    if configured:
        return Path(configured).expanduser()
    return Path(platformdirs.user_config_dir("mlx-gateway")) / "cluster"


def check_key(text: str) -> str:
    """A Z85 public key as given on a command line; a ClusterError says what is wrong."""
    key = text.strip()
    try:
        valid = len(key) == 40 and set(key) <= Z85_CHARS and len(z85.decode(key)) == 32
    except (ValueError, KeyError, IndexError):
        valid = False
    if not valid:
        raise ClusterError(f"{text!r} is not a public key (40 characters of Z85 text)")
    return key


def key_pair(path: Path, create: bool = True) -> KeyPair:
    """The key pair in `path`, made (0600) when there is none and `create` is set."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=KeyPair)
    except FileNotFoundError:
        if not create:
            raise ClusterError(f"no key pair in {path}") from None
    except (OSError, msgspec.DecodeError) as exc:
        raise ClusterError(f"cannot read the key pair in {path}: {exc}") from exc
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    public, secret = zmq.curve_keypair()
    while public.startswith(b"-"):  # Z85 has "-": such a key would read as an option
        public, secret = zmq.curve_keypair()
    pair = KeyPair(public.decode(), secret.decode())
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # made by another process just now: theirs it is
        return key_pair(path, create=False)
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.json.encode(pair))
    return pair


class AllowedWorkers:
    """The workers that may dial in: a JSON file edited under a lock, read again when its
    modification time or size changes (a running gateway sees `workers add` at once)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stat: tuple[int, int, int] | None = None
        self._by_key: dict[str, AllowedWorker] = {}

    def refresh(self) -> dict[str, AllowedWorker]:
        try:
            st = self.path.stat()
            stat: tuple[int, int, int] | None = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            stat = None
        if stat != self._stat:
            self._by_key = {w.public_key: w for w in self._read().workers}
            self._stat = stat
        return self._by_key

    def lookup(self, public_key: str) -> AllowedWorker | None:
        return self.refresh().get(public_key)

    def all(self) -> list[AllowedWorker]:
        return self._read().workers

    def _read(self) -> AllowedFile:
        try:
            return msgspec.json.decode(self.path.read_bytes(), type=AllowedFile)
        except FileNotFoundError:
            return AllowedFile()
        except (OSError, msgspec.DecodeError) as exc:
            raise ClusterError(f"cannot read {self.path}: {exc}") from exc

    @contextlib.contextmanager
    def _locked(self) -> Iterator[AllowedFile]:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = self._read()
            yield data
            tmp = self.path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(msgspec.json.format(msgspec.json.encode(data)))
            os.replace(tmp, self.path)

    def add(self, name: str, public_key: str) -> AllowedWorker:
        if not NAME.match(name):
            raise ClusterError(
                f"{name!r} is not a worker name (letters, digits, '.', '_', '-'; 64 at most)"
            )
        key = check_key(public_key)
        with self._locked() as data:
            for worker in data.workers:
                if worker.name == name:
                    raise ClusterError(f"a worker named {name!r} is already allowed")
                if worker.public_key == key:
                    raise ClusterError(f"that key is already allowed, as {worker.name!r}")
            record = AllowedWorker(name, key, time.time())
            data.workers.append(record)
        return record

    def remove(self, name_or_key: str) -> AllowedWorker:
        with self._locked() as data:
            for worker in data.workers:
                if name_or_key in (worker.name, worker.public_key):
                    data.workers.remove(worker)
                    return worker
        raise ClusterError(f"no allowed worker named {name_or_key!r}")
