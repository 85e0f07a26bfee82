"""The soak script at its smallest: a real gateway and tiny model, workers killed and frozen
every second for five seconds under streamed load with clients leaving; nothing lost, no
request that its worker's death touched ends in an error, no process left behind."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import soak


def test_a_small_soak_loses_nothing(chat_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    args = ["--model", str(chat_model), "--requests", "5000", "--duration", "5"]
    args += ["--concurrency", "8", "--fault-every", "1", "--max-tokens", "48"]
    soak.main([*args, "--heartbeat-timeout", "2", "--disconnect", "0.2", "--json", str(out)])
    report = json.loads(out.read_text())
    assert sum(report["lost"].values()) == 0 and not report["errored"]
    assert report["completed"] + report["disconnected"] == report["requests"] > 0
    assert report["disconnected"] > 0
    assert sum(report["faults"].values()) >= 1 and report["restarts"] >= 1
    assert report["under_fault"] > 0 and report["under_fault_errored"] == 0
    assert report["after_crash"]["resumed"] > 0 and report["left_behind"] == []
