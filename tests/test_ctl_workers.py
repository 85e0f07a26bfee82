"""gatewayctl worker's command line: its default id, the model from this machine's config or
--source, and what it refuses before starting anything."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import zmq

from gateway.ctl.workers import default_id, worker_command
from shared.config import Config, ConfigError, ModelConfig


def args(**given: object) -> argparse.Namespace:
    base = {"gateway": "gw.local:7380", "gateway_key": zmq.curve_keypair()[0].decode()}
    base |= {"model": "m", "source": None, "id": None, "key_file": None}
    return argparse.Namespace(**(base | given))


def test_the_default_id_is_stable_per_machine_key_and_differs_across_keys() -> None:
    one, other = "a" * 40, "b" * 40
    assert default_id("m", one) == default_id("m", one)
    assert default_id("m", one) != default_id("m", other)
    assert default_id("m", one).startswith("m@")


def test_the_command_carries_the_model_and_the_gateways_address(tmp_path: Path) -> None:
    config = Config(models=[ModelConfig(name="m", source="/here/m", preload=False)])
    argv = worker_command(args(key_file=str(tmp_path / "w.key")), config, "k" * 40)
    assert argv[argv.index("--connect") + 1] == "tcp://gw.local:7380"
    model = json.loads(argv[argv.index("--model") + 1])
    assert model["source"] == "/here/m" and model.get("preload", True)
    assert argv[argv.index("--id") + 1] == default_id("m", "k" * 40)
    given = worker_command(args(source="/else", id="w1"), Config(), "k" * 40)
    assert json.loads(given[given.index("--model") + 1])["source"] == "/else"
    assert given[given.index("--id") + 1] == "w1"


@pytest.mark.parametrize(
    ("given", "config", "error"),
    [
        ({"gateway": None}, Config(), "needs --gateway"),
        ({"gateway": "nohost"}, Config(), "not HOST:PORT"),
        ({}, Config(), "give --source"),
        ({}, Config(models=[ModelConfig(name="m", source="/m", shards=2)]), "shards = 2"),
    ],
)
def test_what_it_refuses(given: dict[str, object], config: Config, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        worker_command(args(**given), config, "k" * 40)
