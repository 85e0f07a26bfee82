"""API keys, per-key limits, priority classes and request limits, through real gateways.

Keys are created with the real `gatewayctl keys` (the key file lives in the gateway's run dir);
requests go through the official openai SDK or plain HTTP where headers are checked.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.gateway_proc import GatewayProc, running_gateway, serving, wait_for

MESSAGES = [{"role": "user", "content": "Hello there"}]
ENDLESS = {"max_tokens": 100_000, "stream": True, "extra_body": {"ignore_eos": True}}


def _create(gw: GatewayProc, name: str, *flags: str) -> str:
    out = gw.ctl("keys", "create", name, *flags)
    key = out.stdout.strip()
    assert key.startswith("mgw-"), out
    return key


def _client(gw: GatewayProc, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.base_url}/v1", api_key=key, max_retries=0, timeout=60)


def _chat(gw: GatewayProc, key: str | None, model: str = "chat", **extra: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": model, "messages": MESSAGES, "max_tokens": 3, **extra}
    body = {k: v for k, v in body.items() if v is not None}
    return httpx.post(f"{gw.base_url}/v1/chat/completions", json=body, headers=headers, timeout=60)


def _endless(gw: GatewayProc, key: str, out: list[object]) -> threading.Thread:
    """A streaming request that runs until the test ends (or the gateway stops)."""

    def run() -> None:
        try:
            for _ in _client(gw, key).chat.completions.create(
                model="chat", messages=MESSAGES, **ENDLESS
            ):
                out.append(1)
        except Exception as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def secured(chat_model: Path, other_model: Path) -> Iterator[GatewayProc]:
    models = [
        {
            "name": "chat",
            "source": str(chat_model),
            "aliases": ["assistant"],
            "engine": {"max_context": 1_000_000},
        },
        {"name": "other", "source": str(other_model)},
    ]
    with running_gateway(models, admin_http=True) as gw:
        yield gw


def test_admin_over_http_needs_an_admin_key(secured: GatewayProc) -> None:
    gw = secured
    # Even with no key configured, /admin over HTTP is never open (nor `//admin`: the
    # router merges repeated slashes, and so do the checks)
    for path in ("/admin/ps", "//admin/ps", "/admin//ps"):
        assert httpx.get(f"{gw.base_url}{path}", timeout=10).status_code == 401, path
    admin = _create(gw, "ops", "--scope", "admin")
    user = _create(gw, "user")
    rows = httpx.get(
        f"{gw.base_url}/admin/ps", headers={"Authorization": f"Bearer {admin}"}, timeout=10
    )
    assert rows.status_code == 200 and {r["model"] for r in rows.json()} == {"chat", "other"}
    for path in ("/admin/ps", "//admin/ps"):
        denied = httpx.get(f"{gw.base_url}{path}", headers={"x-api-key": user}, timeout=10)
        assert denied.status_code == 403 and "not admin" in denied.json()["error"]["message"]
    assert _chat(gw, admin).status_code == 200  # admin keys may also infer
    gw.ctl("keys", "revoke", "ops")
    gw.ctl("keys", "revoke", "user")


def test_keys_required_once_one_exists(secured: GatewayProc) -> None:
    gw = secured
    (gw.run_dir / "keys.json").unlink(missing_ok=True)
    assert _chat(gw, None).status_code == 200  # no key file: an open loopback gateway
    key = _create(gw, "alice")
    listing = gw.ctl("keys", "list").stdout
    assert "alice" in listing and key not in listing  # the secret is shown once only
    keyfile = gw.run_dir / "keys.json"
    assert keyfile.stat().st_mode & 0o777 == 0o600
    assert key not in keyfile.read_text()  # stored hashed

    missing = _chat(gw, None)
    assert missing.status_code == 401
    error = missing.json()["error"]
    assert error["type"] == "authentication_error" and "gatewayctl keys create" in error["message"]
    assert missing.headers["x-request-id"]
    with pytest.raises(openai.AuthenticationError):
        _client(gw, "mgw-00000000-not-a-key").chat.completions.create(
            model="chat", messages=MESSAGES, max_tokens=2
        )

    # Bearer (OpenAI) and x-api-key (Anthropic) both work; the SDK sends Bearer.
    done = _client(gw, key).chat.completions.create(model="chat", messages=MESSAGES, max_tokens=2)
    assert done.usage is not None and done.usage.completion_tokens == 2
    body = {"model": "chat", "messages": MESSAGES, "max_tokens": 2}
    by_header = httpx.post(
        f"{gw.base_url}/v1/chat/completions", json=body, headers={"x-api-key": key}, timeout=60
    )
    assert by_header.status_code == 200
    assert by_header.headers["x-request-id"] != missing.headers["x-request-id"]

    # Anthropic paths answer in Anthropic's error shape.
    anthropic = httpx.post(f"{gw.base_url}/v1/messages", json={}, timeout=10)
    assert anthropic.status_code == 401
    assert anthropic.json()["type"] == "error"
    assert anthropic.json()["error"]["type"] == "authentication_error"

    # Probes stay open; metrics need a key.
    assert httpx.get(f"{gw.base_url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{gw.base_url}/metrics", timeout=10).status_code == 401

    # Revocation takes effect on the next request, no restart.
    gw.ctl("keys", "revoke", "alice")
    revoked = _chat(gw, key)
    assert revoked.status_code == 401 and "revoked" in revoked.json()["error"]["message"]
    assert _chat(gw, _create(gw, "bob")).status_code == 200  # and so does creation


def test_a_corrupt_key_file_fails_closed(secured: GatewayProc) -> None:
    gw = secured
    keyfile = gw.run_dir / "keys.json"
    _create(gw, "before-corruption")
    good = keyfile.read_bytes()
    try:
        keyfile.write_text("{not json")
        refused = _chat(gw, None)
        assert refused.status_code == 500
        assert "is not valid" in refused.json()["error"]["message"]
        listing = gw.ctl("keys", "list", check=False)
        assert listing.returncode == 2 and "is not valid" in listing.stderr
    finally:
        keyfile.write_bytes(good)
    assert _chat(gw, None).status_code == 401  # and back to normal


def test_aliases_count_for_a_keys_model_list(secured: GatewayProc) -> None:
    gw = secured  # its chat is also "assistant"
    key = _create(gw, "by-alias", "--models", "assistant")
    assert _chat(gw, key, model="chat").status_code == 200
    assert _chat(gw, key, model="assistant").status_code == 200
    assert _chat(gw, key, model="other").status_code == 403
    assert _chat(gw, key, model="nope").status_code == 404


def test_model_scope_and_expiry(secured: GatewayProc) -> None:
    gw = secured
    scoped = _create(gw, "only-other", "--models", "other")
    assert _chat(gw, scoped, model="other").status_code == 200
    with pytest.raises(openai.PermissionDeniedError) as denied:
        _client(gw, scoped).chat.completions.create(model="chat", messages=MESSAGES, max_tokens=2)
    assert "may not use model 'chat'" in str(denied.value)
    assert [m.id for m in _client(gw, scoped).models.list()] == ["other"]  # only its own

    short = _create(gw, "short-lived", "--expires", "2s")
    assert _chat(gw, short).status_code == 200
    answers: list[httpx.Response] = []

    def refused() -> bool:
        answers.append(_chat(gw, short))
        return answers[-1].status_code != 200

    wait_for(refused, what="the key's expiry")
    expired = answers[-1]
    assert expired.status_code == 401 and "expired" in expired.json()["error"]["message"]
    bad = gw.ctl("keys", "create", "x", "--expires", "yesterday", check=False)
    assert bad.returncode == 2 and "--expires" in bad.stderr


def test_requests_per_minute(secured: GatewayProc) -> None:
    gw = secured
    key = _create(gw, "rpm2", "--rpm", "2")
    first = _chat(gw, key)
    assert first.status_code == 200
    assert first.headers["ratelimit-limit"] == "2"
    assert first.headers["ratelimit-remaining"] == "1"
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert _chat(gw, key).status_code == 200
    third = _chat(gw, key)
    assert third.status_code == 429
    assert third.json()["error"]["type"] == "rate_limit_error"
    assert 1 <= int(third.headers["retry-after"]) <= 60
    assert third.headers["ratelimit-remaining"] == "0"
    with pytest.raises(openai.RateLimitError):
        _client(gw, key).chat.completions.create(model="chat", messages=MESSAGES, max_tokens=2)
    headers = {"authorization": f"Bearer {key}"}
    rerank = {"model": "chat", "query": "q", "documents": ["d"]}
    tokenize = {"model": "chat", "prompt": "q"}
    for path, body in (  # the model routes outside /v1 too, and no `//` around them
        ("/v2/rerank", rerank),
        ("/rerank", rerank),
        ("/tokenize", tokenize),
        ("/detokenize", {"model": "chat", "tokens": [1]}),
        ("//v1/chat/completions", {"model": "chat", "messages": MESSAGES, "max_tokens": 1}),
    ):
        reply = httpx.post(f"{gw.base_url}{path}", json=body, headers=headers, timeout=10)
        assert reply.status_code == 429, (path, reply.text)
    # Limits are per key: another key is unaffected, on any model.
    assert _chat(gw, _create(gw, "rpm-other"), model="other").status_code == 200


def test_tokens_per_minute_and_concurrency(secured: GatewayProc) -> None:
    gw = secured
    tpm = _create(gw, "tpm", "--tpm", "12")
    first = _chat(gw, tpm, max_tokens=4)  # the prompt alone is over 12 tokens
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit-tokens"] == "12"
    second = _chat(gw, tpm, model="other")  # across models
    assert second.status_code == 429 and "tokens per minute" in second.json()["error"]["message"]

    one = _create(gw, "one-at-a-time", "--concurrency", "1")
    chunks: list[object] = []
    stream = _client(gw, one).chat.completions.create(model="chat", messages=MESSAGES, **ENDLESS)

    def read() -> None:
        try:
            for _ in stream:
                chunks.append(1)
        except Exception as exc:  # closed by the test below
            chunks.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    wait_for(lambda: len(chunks) > 2, what="the first stream to run")
    busy = _chat(gw, one, model="other")
    assert busy.status_code == 429 and "in flight" in busy.json()["error"]["message"]
    stream.close()  # the disconnect frees the slot
    wait_for(lambda: _chat(gw, one).status_code == 200, what="the slot to be released")


def test_a_streams_tokens_count_against_its_key_while_it_runs(secured: GatewayProc) -> None:
    """A stream's prompt is charged with its first token, its completion as it goes: a key
    whose minute a running stream has used up is refused before that stream ends."""
    gw = secured
    key = _create(gw, "tpm-stream", "--tpm", "12")
    stream = _client(gw, key).chat.completions.create(model="chat", messages=MESSAGES, **ENDLESS)
    chunks = iter(stream)
    for _ in range(3):  # the first token's delta charged the prompt (over 12 tokens)
        next(chunks)
    refused = _chat(gw, key, model="other")
    assert refused.status_code == 429, refused.text
    assert "tokens per minute" in refused.json()["error"]["message"]
    stream.close()


@pytest.fixture(scope="module")
def own(chat_model: Path) -> Iterator[dict[str, GatewayProc]]:
    """The gateways of the three tests below, each set up its own way, started together (a
    core each): each test waits for its own, and stops it."""

    def chat(**engine: Any) -> list[dict[str, Any]]:
        return [{"name": "chat", "source": str(chat_model), "engine": engine}]

    gateways: dict[str, GatewayProc] = {}
    try:
        # (a test that ends with streams still running has a short drain when it stops)
        gateways["flood"] = GatewayProc(
            chat(max_running=4, batch_share=0.5, max_context=1_000_000), drain_timeout_s=0.5
        )
        gateways["limits"] = GatewayProc(
            chat(), max_tokens_cap=8, max_prompt_tokens=40, max_body_bytes=4096
        )
        gateways["queue"] = GatewayProc(
            chat(max_running=1, max_context=1_000_000), max_queued=1, drain_timeout_s=0.5
        )
        yield gateways
    finally:
        for gw in gateways.values():
            gw.stop()


def test_interactive_key_is_served_while_a_batch_key_floods(own: dict[str, GatewayProc]) -> None:
    """Batch requests hold at most batch_share of max_running: with the batch key's endless
    streams filling its share and more queued behind, an interactive request still starts at
    once (without priority classes it would wait behind the flood for good)."""
    with serving(own["flood"]) as gw:  # max_running 4, batch_share 0.5
        batch = _create(gw, "batch", "--priority", "batch")
        interactive = _create(gw, "ui")
        out: list[object] = []
        for _ in range(6):  # 2 run (half of max_running), 4 wait
            _endless(gw, batch, out)
        # both from one heartbeat: the second running row may not have its first token yet
        wait_for(
            lambda: (row := gw.ps()["chat"])["waiting"] >= 4 and row["running"] == 2,
            what="2 batch requests running, 4 queued",
        )
        started = time.monotonic()
        stream = _client(gw, interactive).chat.completions.create(
            model="chat",
            messages=MESSAGES,
            max_tokens=4,
            stream=True,
            extra_body={"ignore_eos": True},  # a sampled EOS would end it early
        )
        chunks = iter(stream)
        first = next(chunks)
        ttft = time.monotonic() - started
        assert first.choices[0].delta.role == "assistant"
        assert ttft < 20, ttft  # bounded (seconds on a loaded CI box), not forever
        rest = list(chunks)  # it runs to its end while the flood goes on
        assert rest[-1].choices[0].finish_reason == "length"


def test_request_limits(own: dict[str, GatewayProc]) -> None:
    # max_tokens_cap 8, max_prompt_tokens 40, max_body_bytes 4096
    with serving(own["limits"]) as gw:
        over_cap = _chat(gw, None, max_tokens=9)
        assert over_cap.status_code == 400
        assert over_cap.json()["error"]["param"] == "max_tokens"
        assert "server.max_tokens_cap" in over_cap.json()["error"]["message"]
        # No max_tokens: the cap applies.
        capped = _chat(gw, None, max_tokens=None)
        assert capped.status_code == 200 and capped.json()["usage"]["completion_tokens"] <= 8
        # Completions default to 16 tokens, within the cap too.
        completion = httpx.post(
            f"{gw.base_url}/v1/completions",
            json={"model": "chat", "prompt": "Once", "ignore_eos": True},
            timeout=30,
        )
        assert completion.status_code == 200, completion.text
        assert completion.json()["usage"]["completion_tokens"] == 8

        long = [{"role": "user", "content": "word " * 60}]
        too_long = _chat(gw, None, messages=long)
        assert too_long.status_code == 400
        assert "server.max_prompt_tokens" in too_long.json()["error"]["message"]

        huge = _chat(gw, None, messages=[{"role": "user", "content": "x" * 5000}])
        assert huge.status_code == 413
        assert "server.max_body_bytes" in huge.json()["error"]["message"]


def test_queue_full_is_503(own: dict[str, GatewayProc]) -> None:
    with serving(own["queue"]) as gw:  # max_running 1, max_queued 1
        out: list[object] = []
        _endless(gw, "unused", out)  # runs
        wait_for(lambda: 1 in out, what="the first stream to run")
        _endless(gw, "unused", out)  # waits
        wait_for(lambda: gw.ps()["chat"]["in_flight"] == 2, what="the second to queue")
        full = _chat(gw, None)
        assert full.status_code == 503, full.text
        assert full.headers["retry-after"] == "1"
        assert "server.max_queued" in full.json()["error"]["message"]


def test_non_loopback_bind_needs_a_key(tmp_path: Path) -> None:
    config = tmp_path / "gw.toml"
    config.write_text(f'[server]\nkeys_file = "{tmp_path / "keys.json"}"\n')
    cmd = [sys.executable, "-m", "gateway", "--config", str(config), "serve", "--host", "0.0.0.0"]
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2
    assert "gatewayctl keys create" in refused.stderr and "--insecure-no-auth" in refused.stderr


def test_a_rebound_host_name_is_refused_by_the_real_server(secured: GatewayProc) -> None:
    """Through Granian, as a browser sends them: the Host and Origin a DNS-rebinding page
    would send get 403 before any key is looked at; this machine's names are answered."""
    url = f"{secured.base_url}/health"
    assert httpx.get(url, timeout=10).status_code == 200  # Host: 127.0.0.1:PORT
    port = secured.base_url.rsplit(":", 1)[1]
    assert httpx.get(url, headers={"host": f"localhost:{port}"}, timeout=10).status_code == 200
    r = httpx.get(url, headers={"host": f"evil.example:{port}"}, timeout=10)
    assert r.status_code == 403
    assert f"Host 'evil.example:{port}' refused" in r.json()["error"]["message"]
    r = httpx.post(
        f"{secured.base_url}/v1/chat/completions",
        headers={"origin": "http://evil.example", "content-type": "text/plain"},
        content=b'{"model": "chat", "messages": [{"role": "user", "content": "hi"}]}',
        timeout=10,
    )
    assert r.status_code == 403 and "Origin 'http://evil.example' refused" in r.text
