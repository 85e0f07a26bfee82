"""A huggingface_hub cache on disk with one model repository, as downloads leave it:
blobs named by hash, a snapshot of symlinks to them, and refs/main naming the snapshot."""

from __future__ import annotations

import hashlib
from pathlib import Path


def fake_hub_repo(
    cache: Path, repo_id: str, files: dict[str, bytes], commit: str | None = None
) -> Path:
    """Write the repository into `cache` (HF_HUB_CACHE); its snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = commit or hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob.name))
    return snapshot
