"""gateway/edge/keys.py's KeyStore on a key file it cannot read: a clear error, and the
gateway refuses (fails closed) rather than serving without keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.edge.keys import KeyStore
from shared.config import ConfigError


def test_a_key_file_that_cannot_be_read_is_a_config_error(tmp_path: Path) -> None:
    where = tmp_path / "keys.json"
    where.mkdir()  # a directory where the file should be: readable by no one, root included
    with pytest.raises(ConfigError, match=r"keys\.json cannot be read"):
        _ = KeyStore(where).auth_required
    assert not KeyStore(tmp_path / "none.json").auth_required  # no file: no keys yet
