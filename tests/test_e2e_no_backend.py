"""A worker whose MLX has no backend (Linux without mlx[cpu] or mlx[cuda13]) fails its load
with a reason that says what to install, not only a traceback in its log."""

from __future__ import annotations

import os
from pathlib import Path

import httpx

from tests.gateway_proc import running_gateway

FAKE_CORE = 'raise ImportError("libmlx.so: cannot open shared object file: No such file")\n'


def test_a_worker_without_an_mlx_backend_says_what_to_install(
    tmp_path: Path, chat_model: Path
) -> None:
    fake = tmp_path / "site" / "mlx"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "core.py").write_text(FAKE_CORE)
    path = os.pathsep.join(filter(None, [str(fake.parent), os.environ.get("PYTHONPATH")]))
    models = [{"name": "nobackend", "source": str(chat_model), "preload": False}]
    with running_gateway(models, {"PYTHONPATH": path}) as gw:
        r = httpx.post(
            f"{gw.base_url}/v1/chat/completions",
            json={"model": "nobackend", "messages": [{"role": "user", "content": "hi"}]},
            timeout=60,
        )
        assert r.status_code == 503
        row = gw.ps()["nobackend"]
        assert row["state"] == "failed"
        assert "mlx-gateway[cpu]" in row["error"] and "libmlx" in row["error"]
