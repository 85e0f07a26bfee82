"""`gatewayctl chat MODEL`: an interactive chat in the terminal over the gateway's own
OpenAI API (streamed /v1/chat/completions), keeping the conversation. `/exit` or EOF ends it;
Ctrl-C during a reply stops that reply (its stream is closed, so the gateway aborts it)."""

from __future__ import annotations

import contextlib
import json
import os
import ssl
import sys
from collections.abc import Generator
from typing import Any

import httpx

from gateway.ctl import term
from shared.addresses import url_host
from shared.config import Config

API_KEY_ENV = "MLX_GATEWAY_API_KEY"
PROMPT = ">>> "
EXIT = frozenset({"/exit", "/quit", "/bye"})


class ChatError(Exception):
    def __init__(self, message: str, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal  # the next message would fail the same way (key, model)


def base_url(config: Config) -> str:
    """The gateway's own address from its [server] config (a wildcard bind: loopback)."""
    server = config.server
    scheme = "https" if server.tls_cert else "http"
    return f"{scheme}://{url_host(server.host)}:{server.port}"


def run(
    config: Config, model: str, system: str | None, url: str | None, max_tokens: int | None
) -> int:
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input())
    headers = (
        {"Authorization": f"Bearer {os.environ[API_KEY_ENV]}"} if API_KEY_ENV in os.environ else {}
    )
    verify: ssl.SSLContext | bool = True
    if config.server.tls_cert and url is None:  # a self-signed certificate is trusted as its own CA
        verify = ssl.create_default_context(cafile=config.server.tls_cert)
    timeout = httpx.Timeout(30.0, read=None)
    history: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    address = url or base_url(config)
    with httpx.Client(base_url=address, headers=headers, timeout=timeout, verify=verify) as client:
        try:
            _check(client)
        except ChatError as exc:
            return _fail(exc)
        if sys.stdin.isatty():
            print(f"chatting with {model} at {address}; /exit or Ctrl-D ends, Ctrl-C stops a reply")
        return _repl(client, {"model": model, "max_tokens": max_tokens}, history)


def _repl(client: httpx.Client, options: dict[str, Any], history: list[dict[str, Any]]) -> int:
    while True:
        try:
            text = input(PROMPT if sys.stdin.isatty() else "").strip()
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
            print()
            continue
        if not text:
            continue
        if text in EXIT:
            return 0
        history.append({"role": "user", "content": text})
        parts: list[str] = []
        try:
            with contextlib.closing(stream_reply(client, options, history)) as pieces:
                for piece in pieces:
                    parts.append(piece)
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            print()
        except KeyboardInterrupt:
            print("\n[stopped]")
        except ChatError as exc:
            history.pop()
            if exc.fatal:
                return _fail(exc)
            _fail(exc)
            continue
        if parts:  # a stopped reply stays in the conversation as far as it went
            history.append({"role": "assistant", "content": "".join(parts)})
        else:
            history.pop()


def stream_reply(
    client: httpx.Client, options: dict[str, Any], history: list[dict[str, Any]]
) -> Generator[str, None, None]:
    """The reply's text as it streams; leaving early closes the stream."""
    body = {k: v for k, v in options.items() if v is not None}
    body.update(messages=history, stream=True)
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code >= 400:
                response.read()
                raise _http_error(response)
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise ChatError(_message(chunk))
                for choice in chunk.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        yield content
    except httpx.TransportError as exc:
        raise ChatError(f"the connection to the gateway failed: {exc}") from None


def _check(client: httpx.Client) -> None:
    """Reach the gateway and pass its key check before the first prompt."""
    try:
        response = client.get("/v1/models")
    except httpx.TransportError as exc:
        raise ChatError(f"cannot reach the gateway at {client.base_url}: {exc}", True) from None
    if response.status_code >= 400:
        raise _http_error(response)


def _http_error(response: httpx.Response) -> ChatError:
    try:
        message = _message(response.json())
    except ValueError:
        message = response.text.strip() or response.reason_phrase
    status = response.status_code
    hint = ""
    if status == 401 and API_KEY_ENV not in os.environ:
        hint = f" (set {API_KEY_ENV} to an API key: `gatewayctl keys create NAME`)"
    return ChatError(f"{status}: {message}{hint}", fatal=status in (401, 403, 404))


def _message(body: Any) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error or body)


def _fail(exc: ChatError) -> int:
    term.console(stderr=True).print(f"gatewayctl chat: {exc}", style="red")
    return 1
