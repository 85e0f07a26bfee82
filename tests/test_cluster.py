"""Worker keys: key pairs in 0600 files made once, public keys checked, and the allowed
list edited under a lock and read again when it changes."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import zmq

from shared.cluster import AllowedWorkers, ClusterError, check_key, cluster_dir, key_pair


def test_a_key_pair_is_made_once_private_and_then_reused(tmp_path: Path) -> None:
    path = tmp_path / "cluster" / "gateway.key"
    pair = key_pair(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert key_pair(path) == pair
    assert zmq.curve_public(pair.secret.encode()).decode() == pair.public
    with pytest.raises(ClusterError, match="no key pair"):
        key_pair(tmp_path / "missing.key", create=False)
    (tmp_path / "bad.key").write_text("{not json")
    with pytest.raises(ClusterError, match="cannot read"):
        key_pair(tmp_path / "bad.key")


def test_no_key_made_here_reads_as_a_command_line_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = [(b"-" + b"a" * 39, b"s" * 40), (b"b" * 40, b"t" * 40)]
    monkeypatch.setattr(zmq, "curve_keypair", lambda: made.pop(0))
    assert key_pair(tmp_path / "k.key").public == "b" * 40


def test_public_keys_are_checked() -> None:
    public, _ = zmq.curve_keypair()
    assert check_key(f" {public.decode()}\n") == public.decode()
    for bad in ("", "short", "x" * 39 + '"', public.decode()[:-1] + "~"):
        with pytest.raises(ClusterError, match="not a public key"):
            check_key(bad)


def test_allowed_workers_are_added_listed_and_removed(tmp_path: Path) -> None:
    allowed = AllowedWorkers(tmp_path / "workers.json")
    assert allowed.lookup("anything") is None and allowed.all() == []
    key = zmq.curve_keypair()[0].decode()
    record = allowed.add("studio", key)
    assert allowed.lookup(key) == record
    assert stat.S_IMODE((tmp_path / "workers.json").stat().st_mode) == 0o600
    with pytest.raises(ClusterError, match="already allowed"):
        allowed.add("studio", zmq.curve_keypair()[0].decode())
    with pytest.raises(ClusterError, match="already allowed, as 'studio'"):
        allowed.add("other", key)
    with pytest.raises(ClusterError, match="not a worker name"):
        allowed.add("../etc", zmq.curve_keypair()[0].decode())
    # another process's change is seen by a reader that already looked
    reader = AllowedWorkers(tmp_path / "workers.json")
    assert reader.lookup(key) is not None
    assert allowed.remove("studio").public_key == key
    assert reader.lookup(key) is None
    with pytest.raises(ClusterError, match="no allowed worker"):
        allowed.remove("studio")


def test_the_cluster_folder_defaults_to_the_user_config_dir(tmp_path: Path) -> None:
    assert cluster_dir(str(tmp_path)) == tmp_path
    assert cluster_dir(None).name == "cluster"
