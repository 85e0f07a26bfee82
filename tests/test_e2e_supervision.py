"""Model lifecycle through real gateways and workers: JIT load, Ready probe, TTL, drain,
crash recovery with replay, crash loops, wedges, reload and the memory budget.

Faults are injected into real workers with MLX_GATEWAY_FAULTS (worker/faults.py).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from tests.gateway_proc import GatewayProc, openai_client, running_gateway, serving, wait_for

MESSAGES = [{"role": "user", "content": "Tell me a long story."}]
BIG = {"engine": {"max_context": 1_000_000}}  # streams that end only when aborted
FAST_RESTART = {"restart_backoff_s": 0.2, "restart_backoff_max_s": 1.0}
SLOW_LOAD_S = 3.0


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _faults(table: dict[str, dict[str, Any]]) -> dict[str, str]:
    return {"MLX_GATEWAY_FAULTS": json.dumps(table)}


def _chat(gw: GatewayProc, model: str, max_tokens: int = 3, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": MESSAGES, "max_tokens": max_tokens, **extra}
    return httpx.post(f"{gw.base_url}/v1/chat/completions", json=body, timeout=120)


def _spawned(gw: GatewayProc, model: str) -> int:
    text = (gw.run_dir / "gateway.log").read_text(errors="replace")
    return text.count(f"model {model}: worker {model}-")


# ---- JIT load ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jit_gateway(chat_model: Path, other_model: Path) -> Iterator[GatewayProc]:
    models = [
        {"name": "jit", "source": str(other_model), "preload": False},
        {"name": "slow", "source": str(other_model), "preload": False},
        {"name": "broken", "source": str(other_model), "preload": False},
        {"name": "brief", "source": str(chat_model), "preload": False, "ttl": 1},
        {"name": "kept", "source": str(other_model), "preload": False},
    ]
    # "slow" loads for over SLOW_LOAD_S (its start, then that sleep): longer than the gateway
    # waits before its first keep-alive comment (2 s)
    faults = {"slow": {"load_delay_s": SLOW_LOAD_S}, "broken": {"probe_error": "no logits"}}
    with running_gateway(models, _faults(faults), **FAST_RESTART) as gw:
        yield gw


def test_concurrent_requests_load_an_unloaded_model_once(jit_gateway: GatewayProc) -> None:
    assert jit_gateway.ps()["jit"]["state"] == "unloaded"
    results: list[int] = []

    def one() -> None:
        results.append(_chat(jit_gateway, "jit").status_code)

    threads = [threading.Thread(target=one) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [200] * 5
    assert _spawned(jit_gateway, "jit") == 1
    assert jit_gateway.ps()["jit"]["state"] == "ready"


def test_streaming_request_gets_keepalives_while_the_model_loads(jit_gateway: GatewayProc) -> None:
    body = {"model": "slow", "messages": MESSAGES, "max_tokens": 4, "stream": True}
    lines = []
    started = time.monotonic()
    with httpx.stream(
        "POST", f"{jit_gateway.base_url}/v1/chat/completions", json=body, timeout=60
    ) as r:
        assert r.status_code == 200
        first_line_after = None
        for line in r.iter_lines():
            if first_line_after is None:
                first_line_after = time.monotonic() - started
            lines.append(line)
    comments = [x for x in lines if x.startswith(":")]
    data = [x for x in lines if x.startswith("data:")]
    assert comments and "loading model slow" in comments[0]
    # before the load ended (its sleep alone takes SLOW_LOAD_S)
    assert first_line_after is not None and first_line_after < SLOW_LOAD_S
    assert data[-1] == "data: [DONE]" and len(data) >= 3
    assert lines.index(comments[-1]) < lines.index(data[0])


def test_a_stream_waiting_for_its_model_can_be_cancelled(jit_gateway: GatewayProc) -> None:
    """Cancel by id also works while the model is still loading (the 200 is already out)."""
    if jit_gateway.ps()["slow"]["state"] != "unloaded":
        jit_gateway.unload("slow")
    body = {"model": "slow", "messages": MESSAGES, "max_tokens": 4, "stream": True}
    with httpx.stream(
        "POST", f"{jit_gateway.base_url}/v1/chat/completions", json=body, timeout=60
    ) as r:
        assert r.status_code == 200
        request_id = r.headers["x-request-id"]
        cancel = httpx.post(f"{jit_gateway.base_url}/v1/requests/{request_id}/cancel", timeout=10)
        assert cancel.status_code == 200, cancel.text
        assert jit_gateway.ps()["slow"]["state"] == "loading"  # it was cancelled meanwhile
        data = [x for x in r.iter_lines() if x.startswith("data:")]
    assert data[-1] == "data: [DONE]"
    assert json.loads(data[-2][len("data: ") :])["error"]["code"] == "cancelled"
    # The load itself goes on for the requests that still want the model.
    wait_for(lambda: jit_gateway.ps()["slow"]["state"] == "ready", what="the load to finish")


def test_a_model_that_loads_but_cannot_generate_is_failed(jit_gateway: GatewayProc) -> None:
    r = _chat(jit_gateway, "broken")
    assert r.status_code == 503
    assert "cannot generate" in r.json()["error"]["message"]
    row = jit_gateway.ps()["broken"]
    assert row["state"] == "failed" and "no logits" in row["error"]
    # A failed model stays failed (no retry storm) until it is loaded explicitly.
    r = _chat(jit_gateway, "broken")
    assert r.status_code == 503 and "gatewayctl load broken" in r.json()["error"]["message"]


def test_idle_model_unloads_after_its_ttl(jit_gateway: GatewayProc) -> None:
    assert _chat(jit_gateway, "brief").status_code == 200
    pid = jit_gateway.ps()["brief"]["pid"]
    assert pid
    # ttl = 1 s: the worker process ends, so its memory goes back to the OS.
    wait_for(lambda: jit_gateway.ps()["brief"]["state"] == "unloaded", 15, "the ttl unload")
    assert _gone(pid)


def test_keep_alive_per_request(jit_gateway: GatewayProc) -> None:
    assert _chat(jit_gateway, "kept", keep_alive=-1).status_code == 200
    row = jit_gateway.ps()["kept"]
    assert row["ttl_s"] is None  # never
    time.sleep(1.5)
    assert jit_gateway.ps()["kept"]["state"] == "ready"
    pid = row["pid"]
    assert _chat(jit_gateway, "kept", keep_alive=0).status_code == 200
    wait_for(lambda: jit_gateway.ps()["kept"]["state"] == "unloaded", 15, "the unload")
    assert _gone(pid)
    r = _chat(jit_gateway, "kept", keep_alive="soon")
    assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"


def test_load_timeout_is_a_clear_503(chat_model: Path) -> None:
    models = [{"name": "sloth", "source": str(chat_model), "preload": False}]
    faults = {"sloth": {"load_delay_s": 30}}
    with running_gateway(models, _faults(faults), load_timeout_s=1.5) as gw:
        r = _chat(gw, "sloth")
        assert r.status_code == 503 and r.headers.get("retry-after")
        assert "server.load_timeout_s=1.5" in r.json()["error"]["message"]


# ---- leases and drain -------------------------------------------------------------------


def _stream_in_background(
    gw: GatewayProc, model: str, out: list[object], max_tokens: int = 100_000
) -> threading.Thread:
    def run() -> None:
        client = openai_client(gw)
        try:
            stream = client.chat.completions.create(
                model=model,
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=max_tokens,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for _chunk in stream:
                out.append("chunk")
            out.append("finished")
        except openai.APIError as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def drain_gateway(chat_model: Path) -> Iterator[GatewayProc]:
    models = [{"name": "busy", "source": str(chat_model), "engine": {"max_context": 1_000_000}}]
    with running_gateway(models, request_timeout_s=120.0, **FAST_RESTART) as gw:
        yield gw


# ---- reload (first: its model is loaded, the unloads end it) ----------------------------


def test_reload_under_load_fails_no_request(drain_gateway: GatewayProc) -> None:
    gw = drain_gateway
    if gw.ps()["busy"]["state"] != "ready":
        gw.load("busy")
    old = gw.ps()["busy"]["pid"]
    statuses: list[int] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            statuses.append(_chat(gw, "busy", max_tokens=8).status_code)

    threads = [threading.Thread(target=load) for _ in range(3)]
    for t in threads:
        t.start()
    wait_for(lambda: len(statuses) >= 3, what="traffic")
    out = gw.ctl("reload", "busy").stdout
    assert "reloaded" in out
    answered = len(statuses)
    wait_for(lambda: len(statuses) >= answered + 6, what="traffic after the reload")
    stop.set()
    for t in threads:
        t.join(60)
    new = gw.ps()["busy"]["pid"]
    assert new != old
    wait_for(lambda: _gone(old), what="the old worker drained and gone")
    assert statuses and set(statuses) == {200}, statuses


# ---- unload -----------------------------------------------------------------------------


@pytest.mark.parametrize("force", [False, True])
def test_unload_drains_then_aborts_with_a_clear_error(
    drain_gateway: GatewayProc, force: bool
) -> None:
    gw = drain_gateway
    if gw.ps()["busy"]["state"] != "ready":
        gw.load("busy")
    out: list[object] = []
    thread = _stream_in_background(gw, "busy", out)
    wait_for(lambda: len(out) >= 3, what="tokens streaming")
    pid = gw.ps()["busy"]["pid"]
    started = time.monotonic()
    args = ["unload", "busy", "--force"] if force else ["unload", "busy", "--timeout", "1.5"]
    assert "unloaded" in gw.ctl(*args).stdout
    took = time.monotonic() - started
    thread.join(30)
    assert isinstance(out[-1], openai.APIError) and "unloaded" in str(out[-1])
    assert took < (6.0 if force else 10.0)  # gatewayctl's start included; the drain is 30 s
    if not force:
        assert took >= 1.4  # it waited for the drain before aborting
    assert _gone(pid)
    assert gw.ps()["busy"]["state"] == "unloaded"


# ---- crashes ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def crash_gateway(
    chat_model: Path, other_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProc]:
    models = [
        {
            "name": "single",
            "source": str(chat_model),
            "engine": {"max_running": 1, "max_context": 1_000_000},
        },
        {"name": "loop", "source": str(other_model), "preload": False},
        {"name": "flaky", "source": str(other_model), "preload": False},
        {"name": "stall", "source": str(chat_model), "engine": {"max_context": 1_000_000}},
        {"name": "stopped", "source": str(chat_model), "engine": {"max_context": 1_000_000}},
    ]
    starts = tmp_path_factory.mktemp("flaky") / "starts"
    faults = {
        "loop": {"crash_after_ready_s": 0.3},
        # its first three workers die 0.3 s after Ready (one loop), then it heals
        "flaky": {"crash_after_ready_s": 0.3, "crash_starts": 3, "starts_file": str(starts)},
        "stall": {"stall_on": "FREEZE"},
    }
    crash = {"crash_loop_count": 3, "crash_backoff_s": 3.0, "crash_backoff_max_s": 6.0}
    hangs = {"heartbeat_timeout_s": 2.0, "wedge_timeout_s": 2.0, "request_timeout_s": 120.0}
    server = {**FAST_RESTART, **crash, **hangs}
    with running_gateway(models, _faults(faults), **server) as gw:
        yield gw


def test_crash_replays_requests_that_had_not_started_and_resumes_the_rest(
    crash_gateway: GatewayProc,
) -> None:
    gw = crash_gateway
    pid = gw.ps()["single"]["pid"]
    running: list[object] = []
    thread = _stream_in_background(gw, "single", running, max_tokens=3000)
    wait_for(lambda: len(running) >= 3, what="the first request streaming")
    # max_running = 1: this one waits in the worker with nothing sent to its client.
    queued: list[httpx.Response] = []
    waiter = threading.Thread(target=lambda: queued.append(_chat(gw, "single", max_tokens=5)))
    waiter.start()
    wait_for(lambda: gw.ps()["single"]["waiting"] >= 1, what="the second request queued")
    os.kill(pid, signal.SIGKILL)
    thread.join(120)
    waiter.join(120)
    # The request that had streamed tokens goes on on the restarted worker: no error...
    assert running[-1] == "finished" and not any(isinstance(r, Exception) for r in running)
    # ...and the queued one runs there too and succeeds.
    assert queued and queued[0].status_code == 200
    assert queued[0].json()["usage"]["completion_tokens"] == 5
    row = gw.ps()["single"]
    assert row["state"] == "ready" and row["pid"] != pid and row["restarts"] == 1


def test_a_crash_loop_backs_the_model_off(crash_gateway: GatewayProc) -> None:
    gw = crash_gateway
    gw.admin("POST", "/load", json={"model": "loop"}, timeout=120)  # it dies soon after
    wait_for(lambda: gw.ps()["loop"]["state"] == "backoff", timeout=60, what="crash loop")
    row = gw.ps()["loop"]
    assert "crash loop" in row["last_error"] and "exit status 17" in row["last_error"]
    assert row["exit_code"] == 17 and row["restarts"] >= 2 and row["next_attempt_s"] > 0
    r = _chat(gw, "loop")
    assert r.status_code == 503 and "backing off" in r.json()["error"]["message"]
    assert 1 <= int(r.headers["retry-after"]) <= 6
    tables: list[str] = []  # (gatewayctl may start after a 3 s backoff: the next one shows)

    def shown() -> bool:
        tables.append(gw.ctl("ps").stdout)
        return "loop: backing off: crash loop" in tables[-1]

    wait_for(shown, timeout=60, what="gatewayctl ps showing the backoff")
    assert "next attempt in" in tables[-1] and "exit status 17" in tables[-1]
    # else it goes on looping (a worker started every few seconds) through the other tests
    gw.unload("loop")


def test_a_crash_loop_that_heals_serves_again_with_no_command(crash_gateway: GatewayProc) -> None:
    """Three crashes (a loop) back the model off; then its workers live, and it serves: no
    one ran gatewayctl. (Loops in a row back off longer: tests/test_workers_recovery.py.)"""
    gw = crash_gateway
    r = _chat(gw, "flaky")  # loads it on demand; its first workers die soon after Ready
    assert r.status_code in (200, 503)
    wait_for(lambda: gw.ps()["flaky"]["state"] == "backoff", timeout=60, what="a first loop")
    wait_for(
        lambda: gw.ps()["flaky"]["restarts"] >= 3 and gw.ps()["flaky"]["state"] == "ready",
        timeout=90,
        what="the model back after its crashes",
    )
    r = _chat(gw, "flaky", max_tokens=3)
    assert r.status_code == 200, r.text


def test_a_wedged_engine_is_killed_and_restarted(crash_gateway: GatewayProc) -> None:
    gw = crash_gateway
    pid = gw.ps()["stall"]["pid"]
    r = _chat(gw, "stall", messages=[{"role": "user", "content": "FREEZE now"}])
    # Heartbeats went on, the step counter did not: killed after wedge_timeout_s, and the
    # request (nothing sent yet) replayed on the new worker, where it freezes it again...
    assert r.status_code in (200, 503)
    wait_for(lambda: _gone(pid), what="the wedged worker killed")
    wait_for(lambda: gw.ps()["stall"]["restarts"] >= 1, what="a restart")
    assert "stalled" in (gw.ps()["stall"]["last_error"] or "")


def test_a_stopped_worker_is_killed_and_restarted(crash_gateway: GatewayProc) -> None:
    gw = crash_gateway
    pid = gw.ps()["stopped"]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: _gone(pid), timeout=20, what="the stopped worker killed")
    finally:
        if not _gone(pid):
            os.kill(pid, signal.SIGCONT)
    wait_for(lambda: gw.ps()["stopped"]["state"] == "ready", timeout=60, what="restart")
    row = gw.ps()["stopped"]
    assert row["pid"] != pid and "no heartbeat" in row["last_error"]
    assert _chat(gw, "stopped").status_code == 200


# ---- catalog at run time ----------------------------------------------------------------


def test_gatewayctl_load_adds_a_model_at_run_time(
    jit_gateway: GatewayProc, other_model: Path
) -> None:
    gw = jit_gateway
    r = _chat(gw, "extra")
    assert r.status_code == 404  # clients cannot reach models outside the catalog
    out = gw.ctl("load", "extra", "--source", str(other_model), "--alias", "x").stdout
    assert "extra: ready" in out
    assert _chat(gw, "x").status_code == 200
    ids = {m["id"] for m in httpx.get(f"{gw.base_url}/v1/models").json()["data"]}
    assert {"jit", "extra"} <= ids


# ---- memory budget ----------------------------------------------------------------------


def _budget_models(chat_model: Path, other_model: Path) -> list[dict[str, Any]]:
    return [
        {"name": "a", "source": str(chat_model), "memory_gb": 1.0, "preload": False, **BIG},
        {"name": "b", "source": str(other_model), "memory_gb": 1.0, "preload": False, **BIG},
        {
            "name": "vip",
            "source": str(other_model),
            "memory_gb": 1.0,
            "preload": False,
            "priority": 10,
            **BIG,
        },
    ]


@pytest.fixture(scope="module")
def budgets(chat_model: Path, other_model: Path) -> Iterator[dict[str, GatewayProc]]:
    """A gateway for each memory_policy, started together (a core each): each test below
    waits for its own, and stops it."""

    def gateway(policy: str, **server: Any) -> GatewayProc:
        models = _budget_models(chat_model, other_model)
        return GatewayProc(models, memory_budget_gb=1.6, memory_policy=policy, **server)

    gateways: dict[str, GatewayProc] = {}
    try:
        # (b's stream still runs at the end of its test: a short drain when it stops)
        gateways["fail"] = gateway("fail", drain_timeout_s=0.5)
        gateways["preempt"] = gateway("preempt")
        gateways["wait"] = gateway("wait", memory_wait_s=30.0)
        yield gateways
    finally:
        for gw in gateways.values():
            gw.stop()


def test_memory_budget_evicts_the_least_recently_used_idle_model(
    budgets: dict[str, GatewayProc],
) -> None:
    with serving(budgets["fail"]) as gw:
        assert _chat(gw, "a").status_code == 200
        pid_a = gw.ps()["a"]["pid"]
        assert _chat(gw, "b").status_code == 200  # a is idle: evicted
        wait_for(lambda: _gone(pid_a), what="a evicted")
        assert gw.ps()["a"]["state"] == "unloaded" and gw.ps()["b"]["state"] == "ready"
        status = json.loads(gw.ctl("status", "--json").stdout)
        assert status["memory_budget_bytes"] == int(1.6 * 2**30)
        assert "memory budget" in gw.ctl("status").stdout
        # b is busy now: with memory_policy = "fail", a load that does not fit is a 503.
        out: list[object] = []
        _stream_in_background(gw, "b", out)
        wait_for(lambda: len(out) >= 2, what="b busy")
        r = _chat(gw, "a")
        assert r.status_code == 503 and "memory_budget_gb" in r.json()["error"]["message"]
        assert r.headers.get("retry-after")
        assert gw.ps()["b"]["state"] == "ready"


def test_memory_budget_preempts_a_lower_priority_model(budgets: dict[str, GatewayProc]) -> None:
    with serving(budgets["preempt"]) as gw:
        out: list[object] = []
        thread = _stream_in_background(gw, "a", out)
        wait_for(lambda: len(out) >= 2, what="a busy")
        assert _chat(gw, "vip").status_code == 200
        thread.join(30)
        assert isinstance(out[-1], openai.APIError) and "unloaded" in str(out[-1])
        assert gw.ps()["a"]["state"] == "unloaded"


def test_memory_policy_wait_loads_once_a_busy_model_goes_idle(
    budgets: dict[str, GatewayProc],
) -> None:
    with serving(budgets["wait"]) as gw:
        body = {
            "model": "a",
            "messages": MESSAGES,
            "max_tokens": 100_000,
            "stream": True,
            "ignore_eos": True,
        }
        with httpx.stream("POST", f"{gw.base_url}/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(4):
                next(lines)
            results: list[httpx.Response] = []
            waiter = threading.Thread(target=lambda: results.append(_chat(gw, "b")))
            waiter.start()
            wait_for(lambda: gw.ps()["b"]["state"] == "loading", 20, "b waiting for memory")
            assert not results  # b waits for memory while a is busy
        # The stream is closed: a goes idle, is evicted, and b loads.
        waiter.join(60)
        assert results and results[0].status_code == 200
        assert gw.ps()["a"]["state"] == "unloaded"
