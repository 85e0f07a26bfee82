"""The soak script at its smallest: a real gateway and tiny model, a worker killed and the next
one frozen, each two seconds after it is ready, over eight seconds of streamed load with
clients leaving; nothing lost, no request that its worker's death touched ends in an error,
streams cut mid-way resumed, no process left behind. (One kill a second over five seconds
made a single kill, which at times caught no stream past its first token: nothing to
resume, the test red at random, before and after the change that found it.)"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import soak


def test_a_small_soak_loses_nothing(chat_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    args = ["--model", str(chat_model), "--requests", "5000", "--duration", "8"]
    args += ["--concurrency", "8", "--fault-every", "2", "--max-tokens", "48"]
    soak.main([*args, "--heartbeat-timeout", "2", "--disconnect", "0.2", "--json", str(out)])
    report = json.loads(out.read_text())
    assert sum(report["lost"].values()) == 0 and not report["errored"]
    assert report["completed"] + report["disconnected"] == report["requests"] > 0
    assert report["disconnected"] > 0
    assert sum(report["faults"].values()) >= 1 and report["restarts"] >= 1
    assert report["under_fault"] > 0 and report["under_fault_errored"] == 0
    assert report["after_crash"]["resumed"] > 0 and report["left_behind"] == []
