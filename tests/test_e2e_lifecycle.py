"""The gateway's own life: workers never outlive it, and a new gateway cleans up after one."""

from __future__ import annotations

import base64
import io
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.gateway_proc import GatewayProc, serving


def _png() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (10, 200, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


PNG = _png()


def _wav() -> bytes:
    import wave

    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes(b"\x00\x10" * 16000)
    return buffer.getvalue()


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not _gone(pid):
        time.sleep(0.1)
    assert _gone(pid), f"worker {pid} outlived its gateway"


@pytest.fixture(scope="module")
def own(chat_model: Path, other_model: Path) -> Iterator[dict[str, GatewayProc]]:
    """The gateways of the three tests below, started together (a core each): each test
    waits for its own, and stops it."""
    endless = {"name": "m", "source": str(chat_model), "engine": {"max_context": 1_000_000}}
    gateways: dict[str, GatewayProc] = {}
    try:
        for sig in ("SIGTERM", "SIGKILL"):
            gateways[sig] = GatewayProc([{"name": "m", "source": str(other_model)}])
        gateways["timeout"] = GatewayProc([endless], request_timeout_s=1.0)
        yield gateways
    finally:
        for gw in gateways.values():
            gw.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_workers_exit_with_the_gateway(own: dict[str, GatewayProc], sig: signal.Signals) -> None:
    with serving(own[sig.name]) as gw:
        pid = gw.ps()["m"]["pid"]
        gw.proc.send_signal(sig)
        gw.proc.wait(30)
        # SIGTERM: the lifespan unloads; SIGKILL: the worker notices its parent is gone.
        _wait_gone(pid, 15)


def test_request_timeout_aborts_and_reports(own: dict[str, GatewayProc]) -> None:
    import httpx
    import openai

    with serving(own["timeout"]) as gw:  # request_timeout_s 1
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "go on forever"}],
            "max_tokens": 500_000,
            "ignore_eos": True,
        }
        r = httpx.post(f"{gw.base_url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 504
        assert "request_timeout_s" in r.json()["error"]["message"]

        client = openai.OpenAI(base_url=f"{gw.base_url}/v1", api_key="x", max_retries=0)
        sdk_body = {k: v for k, v in body.items() if k != "ignore_eos"}
        stream = client.chat.completions.create(
            stream=True,
            extra_body={"ignore_eos": True},
            **sdk_body,  # type: ignore[call-overload]
        )
        with pytest.raises(openai.APIError, match="timed out"):
            for _ in stream:
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and gw.ps()["m"]["running"]:
            time.sleep(0.2)
        assert gw.ps()["m"]["running"] == 0 and gw.ps()["m"]["in_flight"] == 0


def test_embedded_default_serves_the_demo_model(tmp_path: Path) -> None:
    """No config at all: the gateway generates and serves the random-weight demo model, and
    loads the packaged all-MiniLM-L6-v2 on the first embedding request."""
    import openai

    from tests.gateway_proc import running_gateway

    with running_gateway([], env={"MLX_GATEWAY_CACHE_DIR": str(tmp_path)}) as gw:
        gw.wait_ready(["demo"])
        client = openai.OpenAI(base_url=f"{gw.base_url}/v1", api_key="x", max_retries=0)
        card, minilm, vision, stt, tts = client.models.list().data
        assert card.id == "demo"
        assert "random-weight" in (card.model_extra or {})["description"]
        assert minilm.id == "all-minilm-l6-v2"
        assert (minilm.model_extra or {})["state"] == "unloaded"  # until first used
        r = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )
        assert r.choices[0].message.content
        assert "random-weight demo" in gw.logs()
        assert vision.id == "demo-vision-random"
        assert "random-weight" in (vision.model_extra or {})["description"]
        assert (vision.model_extra or {})["kind"] == "vision"
        assert [(m.id, (m.model_extra or {})["kind"]) for m in (stt, tts)] == [
            ("demo-transcription-random", "transcription"),
            ("demo-speech-random", "speech"),
        ]
        image = "data:image/png;base64," + base64.b64encode(PNG).decode()
        content: Any = [
            {"type": "image_url", "image_url": {"url": image}},
            {"type": "text", "text": "What is it?"},
        ]
        # each of the four loads on its first request: all at once (seconds each, one core)
        with ThreadPoolExecutor(4) as pool:
            vectors = pool.submit(client.embeddings.create, model="embeddings", input=["a", "b"])
            seen = pool.submit(
                lambda: client.chat.completions.create(
                    model="vision", messages=[{"role": "user", "content": content}], max_tokens=8
                )
            )
            heard = pool.submit(
                client.audio.transcriptions.create, model="whisper", file=("a.wav", _wav())
            )
            spoken = pool.submit(
                client.audio.speech.create,
                model="tts",
                input="Hello.",
                voice="alloy",
                response_format="wav",
            )
        assert [len(v.embedding) for v in vectors.result().data] == [384, 384]
        usage = seen.result().usage
        assert usage is not None and usage.prompt_tokens > 20
        assert heard.result().text == "hello world"  # the demo Whisper is scripted to say it
        audio = spoken.result().content
        assert audio[:4] == b"RIFF" and len(audio) > 1000
    assert list(tmp_path.glob("models/demo-llama-*/model.safetensors"))
    assert list(tmp_path.glob("models/demo-qwen2-vl-*/model.safetensors"))


def test_a_new_gateway_ends_leftover_workers_and_stale_sockets(other_model: Path) -> None:
    """A gateway that crashed without its workers noticing (say, a worker run without its
    parent watch): the next one kills the pids in workers.json and replaces stale sockets."""
    import json
    import subprocess
    import sys
    import tempfile

    from tests.gateway_proc import running_gateway

    run_dir = Path(tempfile.mkdtemp(prefix="gw", dir="/tmp"))
    (run_dir / "logs").mkdir()
    leftover = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)", "-m", "worker", "--leftover"]
    )
    try:
        (run_dir / "workers.json").write_text(json.dumps([leftover.pid]))
        for name in ("in.sock", "out.sock"):
            (run_dir / name).write_text("stale")
        models = [{"name": "m", "source": str(other_model)}]
        with running_gateway(models, run_dir=str(run_dir)) as gw:
            assert leftover.wait(15) is not None
            assert not (run_dir / "in.sock").is_file()  # a live socket now, not the stale file
            assert gw.ps()["m"]["state"] == "ready"
    finally:
        if leftover.poll() is None:
            leftover.kill()
            leftover.wait()
