"""Structured logs through a real gateway: JSON lines, the access log, the request id followed
into the worker's log, and no prompt or key in any log unless body logging is switched on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from gateway.edge.logs import text_field
from tests.gateway_proc import GatewayProc, running_gateway, wait_for

SECRET_PROMPT = "zebra-quartz-7781 tell me"


def _json_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def _all_logs(gw: GatewayProc) -> str:
    text = (gw.run_dir / "gateway.log").read_text(errors="replace")
    for log in (gw.run_dir / "logs").glob("*.log"):
        text += log.read_text(errors="replace")
    return text


def _chat(gw: GatewayProc, content: str, **extra: Any) -> httpx.Response:
    body = {"model": "chat", "messages": [{"role": "user", "content": content}], **extra}
    return httpx.post(
        f"{gw.base_url}/v1/chat/completions",
        json=body,
        headers={"X-Request-Id": "client-abc-1"},
        timeout=60,
    )


def test_json_access_log_and_request_id_in_worker_log(chat_model: Path) -> None:
    model = {"name": "chat", "source": str(chat_model), "engine": {"max_prompt_tokens": 60}}
    with running_gateway([model], log_format="json") as gw:
        done = _chat(gw, SECRET_PROMPT, max_tokens=3, user="end-user-7")
        assert done.status_code == 200
        rid = done.headers["x-request-id"]
        assert rid != "client-abc-1"  # the gateway names requests; the client's id is logged

        gateway_log = gw.run_dir / "gateway.log"

        def access_line() -> dict[str, Any] | None:
            for line in _json_lines(gateway_log):
                if line.get("logger") == "gateway.access" and line.get("request_id") == rid:
                    return line
            return None

        wait_for(lambda: access_line() is not None, what="the access log line")
        line = access_line()
        assert line is not None
        assert line["status"] == 200 and line["model"] == "chat" and line["key"] == "-"
        assert line["completion_tokens"] == 3 and line["prompt_tokens"] > 0
        assert line["client_request_id"] == "client-abc-1"
        assert line["user"] == "end-user-7"  # OpenAI's `user`: honoured by logging it
        assert line["duration_ms"] >= line["ttft_ms"] > 0
        # the worker's share of the first token's wait, inside the gateway's
        worker = line["preprocess_ms"] + line["queue_ms"] + line["prefill_ms"]
        assert line["prefill_ms"] > 0 and worker <= line["ttft_ms"] + 0.3  # rounding
        assert {"time", "level", "message"} <= set(line)

        # The worker logs with the same id (a request it rejects logs at INFO).
        rejected = _chat(gw, "word " * 120, max_tokens=3)
        assert rejected.status_code == 400
        bad_id = rejected.headers["x-request-id"]
        worker_log = gw.run_dir / "logs" / "worker-chat.log"

        def worker_line() -> dict[str, Any] | None:
            for entry in _json_lines(worker_log):
                if entry.get("request_id") == bad_id:
                    return entry
            return None

        wait_for(lambda: worker_line() is not None, what="the worker's line for the request")
        entry = worker_line()
        assert entry is not None and entry["model"] == "chat" and "rejected" in entry["message"]

        assert SECRET_PROMPT not in _all_logs(gw)  # prompts stay out of the logs


def test_bodies_are_logged_only_when_asked(chat_model: Path) -> None:
    model = {"name": "chat", "source": str(chat_model)}
    with running_gateway([model], log_bodies=True, log_level="debug") as gw:
        assert _chat(gw, SECRET_PROMPT, max_tokens=2).status_code == 200
        wait_for(lambda: SECRET_PROMPT in _all_logs(gw), what="the body in the log")


def test_a_text_access_line_keeps_a_clients_values_to_their_field() -> None:
    """A path, model or user id a client chose cannot start a line nor forge a field."""
    assert text_field("/v1/chat/completions") == "/v1/chat/completions" and text_field(None) == "-"
    assert text_field(12.5) == "12.5" and text_field("é-ok") == "é-ok"
    forged = "/v1/models\n2030-01-01 00:00:00,000 INFO gateway.access status=200 key=alice"
    assert "\n" not in text_field(forged) and json.loads(text_field(forged)) == forged
    assert text_field("x key=alice") == '"x key=alice"'
    assert text_field('say "hi"') == '"say \\"hi\\""'
