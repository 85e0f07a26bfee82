"""Graceful shutdown through real processes: SIGTERM to `gatewayctl serve` drains in-flight
requests for server.drain_timeout_s, refuses new ones, ends every worker and exits 0."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.gateway_proc import GatewayProc, wait_for

MESSAGES = [{"role": "user", "content": "Tell me a long story."}]


def _stream(gw: GatewayProc, max_tokens: int, out: list[Any]) -> threading.Thread:
    """Server-sent events as raw lines: the last data lines tell how the stream ended."""

    def run() -> None:
        body = {
            "model": "chat",
            "messages": MESSAGES,
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
        }
        try:
            with httpx.stream(
                "POST", f"{gw.base_url}/v1/chat/completions", json=body, timeout=120
            ) as response:
                if response.status_code != 200:
                    out.append(f"status {response.status_code}: {response.read()!r}")
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        out.append(line[6:])
        except httpx.HTTPError as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _family(pid: int) -> list[psutil.Process]:
    proc = psutil.Process(pid)
    return [proc, *proc.children(recursive=True)]


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    left = []
    for proc in procs:
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                left.append(proc)
        except psutil.NoSuchProcess:
            pass
    return left


def _of_run(run_dir: Path) -> list[psutil.Process]:
    """Any process whose command line names this run's directory (workers do)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any(str(run_dir) in arg for arg in proc.info["cmdline"] or []):
            found.append(proc)
    return _alive(found)


def _shutdown(gw: GatewayProc, out: list[Any], bound: float) -> tuple[int, float, int]:
    """SIGTERM once tokens flow; a request made during the drain is refused."""
    wait_for(lambda: len(out) >= 3, timeout=60, what="tokens streaming")
    procs = _family(gw.proc.pid)
    assert len(procs) >= 2  # gatewayctl, the HTTP server's worker, the model worker
    started = time.monotonic()
    gw.proc.send_signal(signal.SIGTERM)
    at_signal = len(out)
    body = {"model": "chat", "messages": MESSAGES, "max_tokens": 1}
    late: list[httpx.Response | httpx.TransportError] = []

    def refused() -> bool:
        """A new request, until the gateway has taken the signal (served until then)."""
        try:
            reply = httpx.post(f"{gw.base_url}/v1/chat/completions", json=body, timeout=10)
        except httpx.TransportError as exc:
            late.append(exc)
            return True
        late.append(reply)
        return reply.status_code != 200

    wait_for(refused, timeout=20, what="new requests refused after SIGTERM")
    assert not str(out[-1]).startswith("[DONE]"), "the stream ended before the signal took"
    if isinstance(late[-1], httpx.TransportError):
        # uvicorn closes its listener at once; Granian keeps it open and answers 503.
        assert "uvicorn" in gw.config.read_text()
    else:
        assert late[-1].status_code == 503, late[-1].text
        assert late[-1].headers.get("retry-after")
        assert late[-1].json()["error"]["code"] == "shutting_down"
    code = gw.proc.wait(bound)
    took = time.monotonic() - started
    assert not _alive(procs), "processes of the gateway outlived it"
    assert not _of_run(gw.run_dir), "worker processes outlived the gateway"
    assert not list(gw.run_dir.glob("*.sock")), "stale sockets in the run dir"
    return code, took, at_signal


def _in_flight(gw: GatewayProc) -> float:
    """Requests the gateway holds for the model, as /metrics says."""
    text = httpx.get(f"{gw.base_url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith('mlxgw_in_flight_requests{model="chat"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(params=["granian", "uvicorn"])
def http_server(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _gateway(chat_model: Path, http_server: str, drain: float) -> GatewayProc:
    models = [{"name": "chat", "source": str(chat_model), "engine": {"max_context": 1_000_000}}]
    gw = GatewayProc(
        models, http_server=http_server, drain_timeout_s=drain, request_timeout_s=120.0
    )
    gw.wait_ready(["chat"])
    return gw


def test_sigterm_lets_in_flight_streams_finish(chat_model: Path, http_server: str) -> None:
    gw = _gateway(chat_model, http_server, drain=60.0)
    try:
        out: list[Any] = []
        thread = _stream(gw, 2000, out)  # long enough to be in flight when refusals start
        code, _took, at_signal = _shutdown(gw, out, bound=60.0 + 20)
        thread.join(10)
        assert len(out) > at_signal + 10  # it kept streaming after SIGTERM
        assert code == 0, gw.logs()
        assert out[-1] == "[DONE]", out[-3:]
        assert '"finish_reason":"length"' in str(out[-2]).replace(" ", ""), out[-3:]
        assert not any('"error"' in str(item) for item in out)
    finally:
        gw.stop()


def test_sigterm_aborts_what_outlasts_the_drain(chat_model: Path, http_server: str) -> None:
    gw = _gateway(chat_model, http_server, drain=1.0)
    try:
        out: list[Any] = []
        plain: list[httpx.Response] = []
        body = {"model": "chat", "messages": MESSAGES, "max_tokens": 100_000, "ignore_eos": True}
        url = f"{gw.base_url}/v1/chat/completions"
        waiter = threading.Thread(
            target=lambda: plain.append(httpx.post(url, json=body, timeout=120)), daemon=True
        )
        waiter.start()
        thread = _stream(gw, 100_000, out)
        # Both requests must be in the gateway before the signal, or the plain one may
        # only connect after it (a refused connection, not the drain's 503).
        wait_for(lambda: _in_flight(gw) >= 2, timeout=60, what="both requests in flight")
        code, took, _ = _shutdown(gw, out, bound=1.0 + 20)
        thread.join(10)
        waiter.join(10)
        assert plain and plain[0].status_code == 503, plain
        assert plain[0].json()["error"]["code"] == "shutting_down"
        assert code == 0, gw.logs()
        assert took >= 0.9  # it waited for the drain
        assert out[-1] == "[DONE]", out[-3:]
        assert '"error"' in str(out[-2]), out[-3:]
    finally:
        gw.stop()


def test_an_open_console_does_not_hold_the_drain(chat_model: Path) -> None:
    """The console's live stream ends when the gateway drains: an open tab must not keep
    the HTTP server waiting until it is killed."""
    gw = _gateway(chat_model, "granian", drain=30.0)
    try:
        events: list[str] = []

        def watch() -> None:
            with httpx.stream("GET", f"{gw.base_url}/console/api/live", timeout=120) as reply:
                for line in reply.iter_lines():
                    events.append(line)

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        wait_for(lambda: any(e.startswith("event: state") for e in events), what="the stream")
        started = time.monotonic()
        gw.proc.send_signal(signal.SIGTERM)
        assert gw.proc.wait(60) == 0, gw.logs()
        assert time.monotonic() - started < 20  # (it was killed after 45 s)
        thread.join(10)
    finally:
        gw.stop()
