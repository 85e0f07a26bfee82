"""gatewayctl worker's command line: its default id, the model from this machine's config or
--source, and what it refuses before starting anything."""

from __future__ import annotations

import argparse
import json
import time
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


def test_the_keeper_starts_its_worker_again_until_told_to_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs of a stand-in worker that exits 1, then 77 (key refused), then 78 (refused by
    the gateway): each is started again, after its wait, until a SIGTERM stops the keeper."""
    import signal
    import sys
    import threading

    from gateway.ctl import workers

    monkeypatch.setattr(workers, "BACKOFF_S", 0.05)
    monkeypatch.setattr(workers, "RETRY_REFUSED_S", 0.05)
    monkeypatch.setattr(workers, "RETRY_REJECTED_S", 0.05)
    runs = tmp_path / "runs"
    script = (
        "import pathlib, sys; p = pathlib.Path(sys.argv[1]); n = len(p.read_text()) "
        "if p.exists() else 0; p.write_text('x' * (n + 1)); sys.exit([1, 77, 78, 0][min(n, 3)])"
    )
    keeper = workers.Keeper([sys.executable, "-c", script, str(runs)], {})

    def stop_after_four() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (not runs.exists() or len(runs.read_text()) < 4):
            time.sleep(0.02)
        keeper._stop(signal.SIGTERM, None)

    stopper = threading.Thread(target=stop_after_four)
    stopper.start()
    try:
        assert keeper.run() == 0
    finally:
        stopper.join()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    assert len(runs.read_text()) >= 4  # crash, refused key, refused worker, and again
    once = workers.Keeper([sys.executable, "-c", "raise SystemExit(5)"], {}, once=True)
    assert once.run() == 5
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
