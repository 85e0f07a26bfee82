"""The soak script at its smallest: a real gateway and tiny model, workers killed and frozen
every half second under streamed load with clients leaving; nothing lost, no request that
its worker's death touched ends in an error, no process left behind."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import soak


def test_a_small_soak_loses_nothing(chat_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    args = ["--model", str(chat_model), "--requests", "48", "--concurrency", "8"]
    args += ["--fault-every", "0.5", "--max-tokens", "48", "--heartbeat-timeout", "2"]
    soak.main([*args, "--disconnect", "0.2", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["requests"] == 48
    assert sum(report["lost"].values()) == 0 and not report["errored"]
    assert report["completed"] + report["disconnected"] == 48 and report["disconnected"] > 0
    assert sum(report["faults"].values()) >= 2 and report["restarts"] >= 2
    assert report["under_fault"] > 0 and report["under_fault_errored"] == 0
    assert report["after_crash"]["resumed"] > 0 and report["left_behind"] == []
