"""Faults through real processes: disconnects, killed workers, load/unload, idle CPU."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from tests.gateway_proc import GatewayProc, openai_client, running_gateway, wait_for

MESSAGES = [{"role": "user", "content": "Tell me a long story."}]


@pytest.fixture(scope="module")
def fault_gateway(chat_model: Path, other_model: Path) -> Iterator[GatewayProc]:
    models = [
        # A context far beyond what a test could generate: requests end only by abort.
        {"name": "victim", "source": str(chat_model), "engine": {"max_context": 1_000_000}},
        {"name": "bystander", "source": str(other_model)},
        {"name": "lazy", "source": str(other_model), "preload": False, "on_demand": "refuse"},
        {"name": "hub", "source": "nobody/no-such-model", "preload": False},
        # loaded with the others (a core each), not in its test
        {"name": "poisoned", "source": str(chat_model)},
    ]
    # A request saying POISON kills its worker once it has made 6 tokens: its continuation
    # on the next worker dies on arrival, every time.
    faults = {"poisoned": {"crash_on": "POISON", "crash_after_tokens": 6}}
    env = {"HF_HUB_OFFLINE": "1", "MLX_GATEWAY_FAULTS": json.dumps(faults)}
    server = {"request_timeout_s": 60.0, "restart_backoff_s": 0.2, "restart_backoff_max_s": 1.0}
    with running_gateway(models, env, **server) as gw:
        yield gw


def test_disconnect_mid_stream_frees_the_slot(fault_gateway: GatewayProc) -> None:
    body = {
        "model": "victim",
        "messages": MESSAGES,
        "max_tokens": 500_000,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{fault_gateway.base_url}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert fault_gateway.ps()["victim"]["in_flight"] == 1
    # The connection is closed: the gateway aborts, the worker drops the request.
    wait_for(lambda: fault_gateway.ps()["victim"]["in_flight"] == 0, what="gateway abort")
    wait_for(
        lambda: fault_gateway.ps()["victim"]["running"] == 0,
        what="worker heartbeat showing the slot free",
    )


def test_disconnect_of_non_streaming_request_frees_the_slot(fault_gateway: GatewayProc) -> None:
    body = {"model": "victim", "messages": MESSAGES, "max_tokens": 500_000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{fault_gateway.base_url}/v1/chat/completions", json=body, timeout=1.5)
    wait_for(lambda: fault_gateway.ps()["victim"]["in_flight"] == 0, what="gateway abort")
    wait_for(lambda: fault_gateway.ps()["victim"]["running"] == 0, what="worker slot freed")


def test_worker_killed_mid_stream_resumes_it_on_the_next_worker(
    fault_gateway: GatewayProc,
) -> None:
    """SIGKILL of the worker mid-stream: the client sees a pause, not an error, and a greedy
    stream's text is the undisturbed run's (the gateway resumes it from its tokens)."""
    client = openai_client(fault_gateway)
    # long enough that the worker is still generating when the client has read 3 chunks
    asked = {"model": "victim", "messages": MESSAGES, "max_tokens": 400, "temperature": 0}
    undisturbed = client.chat.completions.create(**asked, extra_body={"ignore_eos": True})  # type: ignore[call-overload]
    pid = fault_gateway.ps()["victim"]["pid"]
    resumes = fault_gateway.ps()["victim"]["resumed"]
    stream = client.chat.completions.create(
        **asked,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )  # type: ignore[call-overload]
    text, finish, usage = "", None, None
    for seen, chunk in enumerate(stream):
        if seen == 3:
            os.kill(pid, signal.SIGKILL)
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    assert text == undisturbed.choices[0].message.content
    assert finish == "length" and usage is not None and usage.completion_tokens == 400
    assert usage.prompt_tokens == undisturbed.usage.prompt_tokens  # type: ignore[union-attr]
    # The other model kept serving, and the dead one came back on a new worker by itself.
    r = client.chat.completions.create(model="bystander", messages=MESSAGES, max_tokens=3)  # type: ignore[arg-type]
    assert r.usage is not None
    wait_for(lambda: fault_gateway.ps()["victim"]["state"] == "ready", 60, "the restart")
    row = fault_gateway.ps()["victim"]
    assert row["pid"] != pid and row["restarts"] >= 1
    assert row["resumed"] == resumes + 1  # killed mid-stream, not after it
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_non_streaming_request_resumes_too(fault_gateway: GatewayProc) -> None:
    client = openai_client(fault_gateway)
    # long enough to be seen running (ps reads the worker's heartbeats, one a second): 3000
    # tokens take 4-5 s here
    asked = {"model": "victim", "messages": MESSAGES, "max_tokens": 3000, "temperature": 0}
    undisturbed = client.chat.completions.create(**asked, extra_body={"ignore_eos": True})  # type: ignore[call-overload]
    pid = fault_gateway.ps()["victim"]["pid"]
    resumes = fault_gateway.ps()["victim"]["resumed"]
    before = _generated(fault_gateway, "victim")
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(
            lambda: client.chat.completions.create(**asked, extra_body={"ignore_eos": True})  # type: ignore[call-overload]
        )
        # the gateway's live count (the heartbeat's `running` may still be the last request's)
        wait_for(
            lambda: _generated(fault_gateway, "victim") >= before + 50,
            what="the request generating",
        )
        os.kill(pid, signal.SIGKILL)
        resumed = future.result(timeout=120)
    assert resumed.choices[0].message.content == undisturbed.choices[0].message.content
    assert resumed.usage is not None and resumed.usage.completion_tokens == 3000
    # it was killed mid-request, not after it
    assert fault_gateway.ps()["victim"]["resumed"] == resumes + 1


def _generated(gw: GatewayProc, model: str) -> float:
    """Tokens the gateway has seen the model's workers generate, as each step's arrive."""
    text = httpx.get(f"{gw.base_url}/metrics", timeout=10).text
    prefix = f'mlxgw_generated_tokens_total{{model="{model}"}} '
    return next(float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix))


def test_a_poison_request_fails_alone_while_the_others_go_on(fault_gateway: GatewayProc) -> None:
    """Three greedy streams and a request that kills every worker it reaches: the poison
    ends with worker_died after server.resume_max resumes; the others see pauses, no error,
    and the text of an undisturbed run."""
    client = openai_client(fault_gateway)
    asked = {"model": "poisoned", "max_tokens": 200, "temperature": 0}
    prompts = [[{"role": "user", "content": f"Tell story number {i}."}] for i in range(3)]
    undisturbed = [
        client.chat.completions.create(messages=m, **asked, extra_body={"ignore_eos": True})  # type: ignore[call-overload]
        .choices[0]
        .message.content
        for m in prompts
    ]
    before = fault_gateway.ps()["poisoned"]
    started = [threading.Event() for _ in prompts]

    def victim(i: int) -> str:
        stream = client.chat.completions.create(
            messages=prompts[i], stream=True, **asked, extra_body={"ignore_eos": True}
        )  # type: ignore[call-overload]
        text = ""
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
                started[i].set()
        return text

    def poison() -> str:
        poisoned = [{"role": "user", "content": "POISON: a story."}]
        with pytest.raises(openai.APIError) as failed:
            for _ in client.chat.completions.create(
                messages=poisoned, stream=True, **asked, extra_body={"ignore_eos": True}
            ):  # type: ignore[call-overload]
                pass
        return str(failed.value)

    with ThreadPoolExecutor(4) as pool:
        victims = [pool.submit(victim, i) for i in range(3)]
        for event in started:
            assert event.wait(60)
        error = pool.submit(poison).result(timeout=180)
        texts = [v.result(timeout=180) for v in victims]
    assert "resume_max=2" in error and "it may be what kills the worker" in error
    assert texts == undisturbed
    # the poison's last death restarts the model too: it comes back on its own
    wait_for(lambda: fault_gateway.ps()["poisoned"]["state"] == "ready", 60, "the restart")
    row = fault_gateway.ps()["poisoned"]
    assert row["restarts"] - before["restarts"] >= 3
    assert row["died"] - before["died"] == 1 and row["resumed"] - before["resumed"] >= 6
    assert "(this time it alone was on trial)" in fault_gateway.logs()


def test_load_and_unload_with_gatewayctl(fault_gateway: GatewayProc) -> None:
    client = openai_client(fault_gateway)
    assert fault_gateway.ps()["lazy"]["state"] == "unloaded"
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="lazy", messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
    assert info.value.status_code == 503
    assert "gatewayctl load lazy" in str(info.value)

    out = fault_gateway.ctl("load", "lazy").stdout
    assert "lazy: ready" in out
    row = fault_gateway.ps()["lazy"]
    assert row["state"] == "ready" and row["pid"]
    pid = row["pid"]
    r = client.chat.completions.create(model="lazy", messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
    assert r.usage is not None

    table = fault_gateway.ctl("ps").stdout
    assert "lazy" in table and "ready" in table and "MEMORY" in table
    assert "PREFIX CACHE" in table

    out = fault_gateway.ctl("unload", "lazy").stdout
    assert "unloaded" in out
    assert fault_gateway.ps()["lazy"]["state"] == "unloaded"
    # The worker process is gone, so its memory went back to the OS.
    wait_for(lambda: not psutil.pid_exists(pid), what="worker exit")

    bad = fault_gateway.ctl("load", "no-such-model", check=False)
    assert bad.returncode == 1 and "no-such-model" in bad.stderr


def test_admin_socket_is_private(fault_gateway: GatewayProc) -> None:
    mode = (fault_gateway.run_dir / "admin.sock").stat().st_mode & 0o777
    assert mode == 0o600
    assert (fault_gateway.run_dir.stat().st_mode & 0o777) == 0o700


def test_ps_json_fields(fault_gateway: GatewayProc) -> None:
    rows = json.loads(fault_gateway.ctl("ps", "--json").stdout)
    row = next(r for r in rows if r["model"] == "bystander")
    for key in ("model", "state", "pid", "rss_bytes", "running", "waiting", "uptime_s"):
        assert key in row
    assert "prefix_cache" in row  # null until the worker reports its prefix cache


def test_idle_worker_uses_no_cpu(fault_gateway: GatewayProc) -> None:
    proc = psutil.Process(fault_gateway.ps()["bystander"]["pid"])
    before = proc.cpu_times()
    time.sleep(3)
    after = proc.cpu_times()
    used = (after.user - before.user) + (after.system - before.system)
    assert used < 0.15, f"idle worker used {used:.3f}s of CPU in 3s"


def test_unreachable_hub_model_fails_clearly(fault_gateway: GatewayProc) -> None:
    result = fault_gateway.ctl("load", "hub", check=False)
    assert result.returncode == 1
    assert "'hub'" in result.stderr and "nobody/no-such-model" in result.stderr
    assert "Traceback" not in result.stderr
    row = fault_gateway.ps()["hub"]
    assert row["state"] == "failed" and "nobody/no-such-model" in row["error"]
    r = httpx.post(
        f"{fault_gateway.base_url}/v1/chat/completions",
        json={"model": "hub", "messages": MESSAGES},
        timeout=30,
    )
    assert r.status_code == 503 and "nobody/no-such-model" in r.json()["error"]["message"]


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="Linux only")
def test_workers_run_with_optimized_blas(fault_gateway: GatewayProc) -> None:
    from shared.blas import resolve_blas

    lib = resolve_blas("auto")
    if lib is None:
        pytest.skip("no OpenBLAS installed")
    pid = fault_gateway.ps()["bystander"]["pid"]
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert "libopenblas" in maps


def test_admin_api_rejects_bad_input(fault_gateway: GatewayProc) -> None:
    transport = httpx.HTTPTransport(uds=str(fault_gateway.run_dir / "admin.sock"))
    with httpx.Client(transport=transport, base_url="http://gw", timeout=30) as admin:
        r = admin.post("/load", json={"model": 5})
        assert r.status_code == 400 and "error" in r.json()
        r = admin.post("/load", content=b"{not json")
        assert r.status_code == 400
        r = admin.post("/unload", json={"model": "no-such-model"})
        assert r.status_code == 404 and "no-such-model" in r.json()["error"]
        r = admin.post("/unload", json={"model": "bystander", "surprise": True})
        assert r.status_code == 400
        r = admin.post("/load", json={"model": "bystander", "source": "/elsewhere"})
        assert r.status_code == 400 and "only adds models" in r.json()["error"]
        r = admin.post("/load", json={"model": "new", "source": "/m", "ttl": "whenever"})
        assert r.status_code == 400 and "ttl" in r.json()["error"]
        r = admin.get("/logs", params={"model": "bystander", "offset": "x"})
        assert r.status_code == 400
        r = admin.get("/logs", params={"model": "bystander", "offset": 10**12})
        assert r.status_code == 200 and r.json()["text"] == ""
        r = admin.post("/reload", json={"model": "no-such-model"})
        assert r.status_code == 404
    assert fault_gateway.ps()["bystander"]["state"] == "ready"
