"""A real OpenSSH server on loopback for the tests: its own host key, a key pair for the
client, this user only, no passwords; started on a free port and stopped after."""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SSHD = Path("/usr/sbin/sshd")


@dataclass(frozen=True, slots=True)
class Sshd:
    port: int
    user: str
    ssh: list[str]  # the ssh command line that logs in to it (the target follows)


def available() -> str | None:
    """Why no server can run here, or None."""
    if not SSHD.exists():
        return f"no OpenSSH server ({SSHD}; ./dev test installs openssh-server with apt)"
    if shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        return "no OpenSSH client (ssh, ssh-keygen)"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _keygen(path: Path) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)],
        check=True,
        capture_output=True,
    )


@contextmanager
def running_sshd(root: Path, also: tuple[str, ...] = ()) -> Iterator[Sshd]:
    """A server on 127.0.0.1 and on the loopback addresses `also` (127.0.0.2: a "machine"
    that mpirun does not take for this one)."""
    root.mkdir(parents=True, exist_ok=True)
    _keygen(root / "host")
    _keygen(root / "client")
    keys = root / "authorized_keys"
    keys.write_bytes((root / "client.pub").read_bytes())
    keys.chmod(0o600)
    port = _free_port()
    (root / "sshd_config").write_text(
        f"Port {port}\n"
        + "".join(f"ListenAddress {a}\n" for a in ("127.0.0.1", *also))
        + f"HostKey {root / 'host'}\n"
        f"AuthorizedKeysFile {keys}\nPidFile {root / 'sshd.pid'}\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
        "StrictModes no\nPermitRootLogin prohibit-password\nLogLevel ERROR\n"
    )
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # its privilege separation
    log = open(root / "sshd.log", "ab")  # noqa: SIM115
    server = subprocess.Popen(
        [str(SSHD), "-D", "-e", "-f", str(root / "sshd_config")], stdout=log, stderr=log
    )
    ssh = [
        "ssh",
        "-p",
        str(port),
        "-i",
        str(root / "client"),
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "UserKnownHostsFile=/dev/null",
        "-o",
        "LogLevel=ERROR",
    ]
    user = getpass.getuser()
    try:
        deadline = time.monotonic() + 20
        while True:  # until a login works (the server listens, the key is taken)
            probe = subprocess.run(
                [*ssh, f"{user}@127.0.0.1", "true"], capture_output=True, timeout=20
            )
            if probe.returncode == 0:
                break
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"sshd did not take a login: {probe.stderr.decode()!r}; "
                    f"{(root / 'sshd.log').read_text()!r}"
                )
            time.sleep(0.1)
        yield Sshd(port, user, ssh)
    finally:
        server.terminate()
        server.wait(timeout=10)
        log.close()
