"""The serving benchmark on a shared virtual machine: the host's steal time is recorded per
level, and a level measured while the host withheld CPU is measured again, with fresh
prompts (no prompt cache may see them twice). Runs the real benchmark against the session
gateway and the in-process ceiling on the tiny chat model."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import _cpu
from benchmarks._prompts import PromptBank
from tests.gateway_proc import GatewayProc

REPO = Path(__file__).resolve().parent.parent


def bench_cmd(gateway: GatewayProc, chat_model: Path, out: Path, *levels: str) -> list[str]:
    """The serving benchmark against the session gateway and the in-process ceiling."""
    return [
        sys.executable, "-m", "benchmarks.serving",
        "--inprocess", str(chat_model),
        "--target", f"gw={gateway.base_url}", "--served-model", "gw=chat",
        "--requests", "2", "--prompt-tokens", "32", "--wait-idle", "0", "--blas", "off",
        "--out", str(out), *levels,
    ]  # fmt: skip


def test_steal_is_apart_from_busy_time() -> None:
    cores = os.cpu_count() or 1
    a, b = _cpu.Sample(busy=100, steal=10, total=1000), _cpu.Sample(300, 60, 2000)
    assert _cpu.busy_pct(a, b) == round(100 * cores * 200 / 1000, 1)
    assert _cpu.steal_pct(a, b) == round(100 * cores * 50 / 1000, 1)
    assert _cpu.steal_pct(b, a) is None and _cpu.steal_pct(None, b) is None
    assert _cpu.contended({"steal_pct": 20.0}, 15.0)
    assert not _cpu.contended({"steal_pct": 15.0}, 15.0)
    assert not _cpu.contended({"steal_pct": None}, 15.0)
    assert not _cpu.contended({"steal_pct": 90.0}, None)
    kept = _cpu.least_stolen([{"steal_pct": 30.0}, {"steal_pct": 20.0}, {"steal_pct": 25.0}], 15.0)
    assert kept["steal_pct"] == 20.0 and kept["contended"] is True
    assert [d["steal_pct"] for d in kept["discarded"]] == [30.0, 25.0]


def test_each_attempt_gets_its_own_prompts() -> None:
    args = argparse.Namespace(prompt_tokens=32, requests=2, min_requests=2)
    bank = PromptBank(args, None)
    first, again = bank.get(0, 1, 0), bank.get(0, 1, 0, attempt=1)
    assert len(first) == len(again) == 2
    assert not set(first) & set(again)
    assert bank.get(0, 1, 0) == first


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="steal time is read from /proc/stat")
def test_a_level_under_steal_is_measured_again(
    gateway: GatewayProc, chat_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "bench.json"
    cmd = bench_cmd(gateway, chat_model, out, "--concurrency", "1", "--max-tokens", "32")
    cmd += ["--max-steal", "-1", "--steal-retries", "1"]  # every level counts as contended
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.count("steal over the limit, measured again") == 2
    results = json.loads(out.read_text())
    (model,) = results["models"].values()
    for source in (model["inprocess"], model["targets"]["gw"]):
        (level,) = source["levels"]
        (run,) = level["runs"]
        assert run["failures"] == 0 and run["steal_pct"] is not None
        assert [d["steal_pct"] is not None for d in run["discarded"]] == [True]
        assert run["contended"] is True  # even the kept attempt was over a limit of -1


def test_warm_levels_run_each_level_once_before_measuring(
    gateway: GatewayProc, chat_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "bench.json"
    cmd = bench_cmd(gateway, chat_model, out, "--concurrency", "1,2", "--max-tokens", "8")
    cmd += ["--warm-levels"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for source in ("inprocess", "gw"):
        warmed = [line for line in done.stderr.splitlines() if line.startswith(f"[{source}]")]
        assert [w for w in warmed if w.endswith("warmed")] == [
            f"[{source}] c=1 warmed",
            f"[{source}] c=2 warmed",
        ]
        # each measured level's line gives its first-token time (the ceiling's too)
        measured = [w for w in warmed if " tok/s=" in w]
        assert len(measured) == 2 and all(" ttft_p50=" in w for w in measured)
    (model,) = json.loads(out.read_text())["models"].values()
    for source in (model["inprocess"], model["targets"]["gw"]):
        assert [lv["runs"][0]["requests"] for lv in source["levels"]] == [2, 2]
    # the gateway's own account (its /metrics): where its first tokens waited in the worker,
    # and its view of the time between tokens beside the client's
    for level in model["targets"]["gw"]["levels"]:
        run = level["runs"][0]
        assert run["prefill_mean_ms"] > 0 and run["queue_mean_ms"] >= 0
        # (a loaded client may read a request's few tokens in one chunk: 0 between them)
        assert run["gateway_itl_mean_ms"] > 0 and run["itl_mean_ms"] >= 0
    assert all("prefill_mean_ms" not in lv["runs"][0] for lv in model["inprocess"]["levels"])
