"""API keys: created by `gatewayctl keys`, stored hashed in a 0600 JSON file, checked per request.

A key reads `mgw-<id>-<secret>`: `id` (8 hex digits) names the record, `secret` is 32 random
bytes (url-safe base64). The file keeps only the SHA-256 of the whole key: the secret is
shown once, at creation. With 256 random bits a fast hash is the right one (a slow password
hash guards guessable secrets and would cost every request); the comparison is
`hmac.compare_digest`, in constant time.

The gateway re-reads the file when it changes (one `stat` per request), so `keys create` and
`keys revoke` take effect without a restart. Writers take an exclusive lock and replace the
file atomically.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import hashlib
import hmac
import logging
import os
import secrets
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import msgspec
import platformdirs

from shared.config import ConfigError, parse_duration

log = logging.getLogger("gateway")

PREFIX = "mgw"
Scope = Literal["inference", "admin"]
Priority = Literal["interactive", "batch"]


class ApiKey(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    id: str
    name: str
    hash: str  # hex SHA-256 of the whole key
    created_at: float
    scope: Scope = "inference"
    models: list[str] = []  # empty: every model
    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # prompt + completion tokens per minute
    concurrency: int | None = None  # requests in flight at once
    priority: Priority = "interactive"
    expires_at: float | None = None
    revoked_at: float | None = None

    def active(self, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        return self.revoked_at is None and (self.expires_at is None or now < self.expires_at)

    def allows_model(self, model: str) -> bool:
        return not self.models or model in self.models

    @property
    def display(self) -> str:
        return f"{PREFIX}-{self.id}-..."


class KeyFile(msgspec.Struct, forbid_unknown_fields=True):
    version: int = 1
    keys: list[ApiKey] = []


class KeyError_(Exception):
    """A `gatewayctl keys` failure with a message for the user."""


def default_keys_file() -> Path:
    return Path(platformdirs.user_config_dir("mlx-gateway")) / "keys.json"


def keys_path(configured: str | None) -> Path:
    return Path(configured).expanduser() if configured else default_keys_file()


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse_expiry(text: str, now: float | None = None) -> float:
    """A duration from now ("30d", "12h", "3600") or a date / ISO time ("2027-01-31")."""
    now = time.time() if now is None else now
    try:
        seconds = parse_duration(text, "--expires")
    except ConfigError:
        try:
            when = dt.datetime.fromisoformat(text)
        except ValueError:
            raise KeyError_(
                f"--expires: {text!r} is neither a duration (30d, 12h) nor a date (2027-01-31)"
            ) from None
        if when.tzinfo is None:
            when = when.astimezone()  # local time, as a user typing a date means
        seconds = when.timestamp() - now
    if seconds <= 0:
        raise KeyError_(f"--expires: {text!r} is not in the future")
    return now + seconds


class KeyStore:
    """The key file, cached and re-read when it changes on disk."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._keys: dict[str, ApiKey] = {}

    # ---- reading (the gateway, per request) -------------------------------------------

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def refresh(self) -> dict[str, ApiKey]:
        stamp = self._stat()
        if stamp == self._stamp:
            return self._keys
        with self._lock:
            if stamp is None:
                self._keys = {}
            else:
                self._keys = {k.id: k for k in self._read().keys}
                mode = os.stat(self.path).st_mode & 0o777
                if mode & 0o077:
                    log.warning(
                        "key file %s has mode %o: others can read the key hashes (chmod 600 %s)",
                        self.path,
                        mode,
                        self.path,
                    )
            self._stamp = stamp
        return self._keys

    def _read(self) -> KeyFile:
        try:
            return msgspec.json.decode(self.path.read_bytes(), type=KeyFile)
        except FileNotFoundError:
            return KeyFile()
        except OSError as exc:  # no permission, a directory: refuse (fail closed), saying why
            why = exc.strerror or exc
            raise ConfigError(f"key file {self.path} cannot be read: {why}") from exc
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ConfigError(f"key file {self.path} is not valid: {exc}") from exc

    @property
    def auth_required(self) -> bool:
        """Once a key has been created, every request needs one (revoked ones count: revoking
        the last key does not open the gateway; delete the file for that)."""
        return bool(self.refresh())

    def active_count(self) -> int:
        now = time.time()
        return sum(1 for k in self.refresh().values() if k.active(now))

    def _match(self, presented: str) -> ApiKey | None:
        key = presented.strip()
        parts = key.split("-", 2)
        record = None
        if len(parts) == 3 and parts[0] == PREFIX:
            record = self.refresh().get(parts[1])
        # The same hash and comparison whether or not the id exists: timing tells nothing.
        expected = record.hash if record is not None else "0" * 64
        same = hmac.compare_digest(digest(key), expected)
        return record if same and record is not None else None

    def verify(self, presented: str) -> ApiKey | None:
        """The active key that `presented` is, or None."""
        record = self._match(presented)
        return record if record is not None and record.active() else None

    def lookup(self, presented: str) -> ApiKey | None:
        """The record of a genuine key, active or not (to say "revoked" or "expired")."""
        return self._match(presented)

    # ---- writing (gatewayctl keys) -------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[KeyFile]:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        lock_path = self.path.with_name(self.path.name + ".lock")
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            data = self._read()
            yield data
            self._write(data)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _write(self, data: KeyFile) -> None:
        fd, tmp = tempfile.mkstemp(prefix=".keys-", dir=self.path.parent)
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(msgspec.json.format(msgspec.json.encode(data)))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def create(
        self,
        name: str,
        *,
        scope: Scope = "inference",
        models: list[str] | None = None,
        rpm: int | None = None,
        tpm: int | None = None,
        concurrency: int | None = None,
        priority: Priority = "interactive",
        expires_at: float | None = None,
    ) -> tuple[str, ApiKey]:
        """A new key: (the secret key, shown once; its record)."""
        if not name or len(name) > 64 or not name.replace("-", "").replace("_", "").isalnum():
            raise KeyError_(f"key name {name!r}: 1-64 letters, digits, '-' or '_'")
        for what, value in (("rpm", rpm), ("tpm", tpm), ("concurrency", concurrency)):
            if value is not None and value < 1:
                raise KeyError_(f"--{what} must be at least 1")
        with self._locked() as data:
            if any(k.name == name and k.revoked_at is None for k in data.keys):
                raise KeyError_(f"a key named {name!r} exists (revoke it first)")
            taken = {k.id for k in data.keys}
            key_id = secrets.token_hex(4)
            while key_id in taken:
                key_id = secrets.token_hex(4)
            secret = f"{PREFIX}-{key_id}-{secrets.token_urlsafe(32)}"
            record = ApiKey(
                id=key_id,
                name=name,
                hash=digest(secret),
                created_at=time.time(),
                scope=scope,
                models=sorted(set(models or [])),
                rpm=rpm,
                tpm=tpm,
                concurrency=concurrency,
                priority=priority,
                expires_at=expires_at,
            )
            data.keys.append(record)
        return secret, record

    def revoke(self, name_or_id: str) -> ApiKey:
        with self._locked() as data:
            for i, key in enumerate(data.keys):
                if key.revoked_at is None and name_or_id in (key.name, key.id):
                    data.keys[i] = msgspec.structs.replace(key, revoked_at=time.time())
                    return data.keys[i]
        raise KeyError_(f"no active key named {name_or_id!r} (see `gatewayctl keys list`)")

    def all(self) -> list[ApiKey]:
        return list(self._read().keys)
