"""load_config's server settings: lifecycle, images, slow clients, the response store, the
port, and a config file that cannot be read."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.config import ConfigError, ServerConfig, load_config


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CONFIG", "HOST", "PORT", "RUN_DIR", "BLAS"):
        monkeypatch.delenv(f"MLX_GATEWAY_{name}", raising=False)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("value", [0, -1])
def test_a_response_store_holds_at_least_one(tmp_path: Path, value: int) -> None:
    with pytest.raises(ConfigError, match=r"server\.responses_max_stored must be at least 1"):
        load_config(write(tmp_path, f"[server]\nresponses_max_stored = {value}\n"))


def test_a_config_that_cannot_be_read_or_a_port_out_of_range_is_said(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(tmp_path)  # a directory
    with pytest.raises(ConfigError, match=r"server\.port must be 0-65535, not 99999"):
        load_config(write(tmp_path, "[server]\nport = 99999\n"))


def test_lifecycle_settings(tmp_path: Path) -> None:
    text = """
[server]
default_ttl = "30m"
memory_budget_gb = 12.5
memory_policy = "preempt"
crash_loop_count = 3

[[models]]
name = "a"
source = "/m/a"
ttl = 600
on_demand = "refuse"
memory_gb = 4.0
priority = 2
"""
    config = load_config(write(tmp_path, text))
    assert config.server.default_ttl == "30m" and config.server.memory_policy == "preempt"
    assert config.server.memory_budget_gb == 12.5 and config.server.crash_loop_count == 3
    model = config.models[0]
    assert (model.ttl, model.on_demand, model.memory_gb, model.priority) == (600, "refuse", 4.0, 2)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('[server]\ndefault_ttl = "later"', "server.default_ttl"),
        ('[server]\nmemory_policy = "pray"', "memory_policy"),
        ('[server]\nhosted_tools = "ignore"', "hosted_tools"),
        ("[server]\nhosted_tools = 1", "hosted_tools"),
        ('[[models]]\nname = "a"\nsource = "/m"\nttl = "x"', "'a': ttl"),
        ('[[models]]\nname = "a"\nsource = "/m"\non_demand = "maybe"', "on_demand"),
        ('[[models]]\nname = "a"\nsource = "/m"\nmemory_gb = 0', "memory_gb"),
    ],
)
def test_bad_lifecycle_settings_are_named(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_config(write(tmp_path, text))


def test_image_settings(tmp_path: Path) -> None:
    server = ServerConfig()
    assert (server.image_max_bytes, server.image_max_pixels) == (20 * 2**20, 8192 * 8192)
    assert (server.image_max_count, server.image_fetch_timeout_s) == (16, 10.0)
    assert server.image_fetch_private is False
    text = "[server]\nimage_max_count = 2\nimage_fetch_private = true\n"
    config = load_config(write(tmp_path, text))
    assert config.server.image_max_count == 2 and config.server.image_fetch_private is True


@pytest.mark.parametrize(
    "setting",
    [
        "image_max_bytes = 0",
        "image_max_pixels = -1",
        "image_max_count = 0",
        "image_fetch_timeout_s = 0",
        "image_fetch_timeout_s = inf",
        "image_max_total_pixels = 0",
    ],
)
def test_bad_image_settings_are_named(tmp_path: Path, setting: str) -> None:
    with pytest.raises(ConfigError, match=f"server.{setting.split()[0]}"):
        load_config(write(tmp_path, f"[server]\n{setting}\n"))


@pytest.mark.parametrize(
    "setting",
    ["header_read_timeout_s = 0", "body_read_timeout_s = -1", "send_timeout_s = inf"],
)
def test_slow_client_timeouts_are_positive_and_named(tmp_path: Path, setting: str) -> None:
    server = ServerConfig()
    assert (server.header_read_timeout_s, server.body_read_timeout_s) == (30.0, 60.0)
    assert server.send_timeout_s == 60.0
    with pytest.raises(ConfigError, match=f"server.{setting.split()[0]}"):
        load_config(write(tmp_path, f"[server]\n{setting}\n"))
