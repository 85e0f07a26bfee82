"""Vision end to end: the official openai and anthropic SDKs, a real gateway, a real vision
worker (a tiny random Qwen2-VL on mlx-vlm) beside a text worker: images as data URLs, as
base64 blocks and fetched by URL, in all three APIs, streamed and not; the prefix cache
reporting the image reused; concurrent image and text requests; and the 400s."""

from __future__ import annotations

import base64
import io
import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anthropic
import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.gateway_proc import GatewayProc, openai_client, running_gateway

pytest.importorskip("mlx_vlm")


def png(seed: int, size: tuple[int, int] = (100, 80)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


class Images(BaseHTTPRequestHandler):
    """Serves /a.png (an image) and /text (not one) on 127.0.0.1."""

    def do_GET(self) -> None:
        body, kind = (png(7), "image/png") if self.path == "/a.png" else (b"hello", "text/plain")
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def images() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def gw(vision_model_dir: Path, chat_model: Path) -> Iterator[GatewayProc]:
    models: list[dict[str, Any]] = [
        {"name": "vision", "source": str(vision_model_dir)},
        {"name": "text", "source": str(chat_model), "preload": False},
        # loaded with the first (a core each: the test then waits only for its restarts)
        {"name": "fragile", "source": str(vision_model_dir)},
    ]
    faults = {"fragile": {"crash_on": "CRASH"}}  # dies once that request's first token left
    env = {"MLX_GATEWAY_FAULTS": json.dumps(faults)}
    server = {
        "request_timeout_s": 60.0,
        # the test's image server is on 127.0.0.1: allowed here (refused by default)
        "image_fetch_private": True,
        # fragile's deaths: each next worker after 0.2 s, not the default 1 s doubling per death
        "restart_backoff_s": 0.2,
        "restart_backoff_max_s": 1.0,
    }
    with running_gateway(models, env, **server) as proc:
        yield proc


@pytest.fixture(scope="module")
def oai(gw: GatewayProc) -> openai.OpenAI:
    return openai_client(gw)


def ask(image_url: str, text: str = "What is in the picture?") -> list[Any]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_url}},
                {"type": "text", "text": text},
            ],
        }
    ]


def test_models_lists_the_vision_model_with_its_kind(gw: GatewayProc) -> None:
    listed = httpx.get(f"{gw.base_url}/v1/models").json()["data"]
    vision = next(m for m in listed if m["id"] == "vision")
    assert vision["kind"] == "vision"
    assert "vision" in vision["capabilities"]


def test_openai_chat_with_an_image_streamed_and_not_and_the_second_time_cached(
    oai: openai.OpenAI,
) -> None:
    messages = ask(data_url(png(1)))
    first = oai.chat.completions.create(
        model="vision", messages=messages, max_tokens=8, temperature=0
    )
    assert first.choices[0].message.content
    assert first.usage is not None and first.usage.prompt_tokens > 20  # the image's tokens
    again = oai.chat.completions.create(
        model="vision", messages=messages, max_tokens=8, temperature=0
    )
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    stream = oai.chat.completions.create(
        model="vision",
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == first.choices[0].message.content
    # another image of the same size: nothing of it comes from the cache
    other = oai.chat.completions.create(
        model="vision", messages=ask(data_url(png(2))), max_tokens=8, temperature=0
    )
    assert other.usage is not None and other.usage.prompt_tokens_details is not None
    assert other.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens // 2


def test_an_image_by_url_is_fetched_by_the_gateway(oai: openai.OpenAI, images: str) -> None:
    by_url = oai.chat.completions.create(
        model="vision", messages=ask(f"{images}/a.png"), max_tokens=6, temperature=0
    )
    inline = oai.chat.completions.create(
        model="vision", messages=ask(data_url(png(7))), max_tokens=6, temperature=0
    )
    assert by_url.choices[0].message.content == inline.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="vision", messages=ask(f"{images}/text"), max_tokens=4)
    assert caught.value.body["param"] == "messages[0].content[0].image_url.url"  # type: ignore[index]


def test_anthropic_and_responses_take_images(gw: GatewayProc, oai: openai.OpenAI) -> None:
    client = anthropic.Anthropic(base_url=gw.base_url, api_key="x", max_retries=0)
    image = base64.b64encode(png(3)).decode()
    message = client.messages.create(
        model="vision",
        max_tokens=6,
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": image},
                    },
                    {"type": "text", "text": "Describe it."},
                ],
            }
        ],
        extra_body={"temperature": 0},
    )
    assert message.content and message.usage.input_tokens > 20
    response = oai.responses.create(
        model="vision",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(png(3))},
                    {"type": "input_text", "text": "Describe it."},
                ],
            }
        ],
        max_output_tokens=6,
        temperature=0,
    )
    assert response.output_text and response.usage is not None
    assert response.usage.input_tokens > 20


def test_image_and_text_requests_at_once_all_answer_as_alone(oai: openai.OpenAI) -> None:
    def run(i: int) -> str:
        messages: list[Any] = (
            ask(data_url(png(10 + i)), f"Question {i}?")
            if i % 2
            else [{"role": "user", "content": f"Tell me about {i}."}]
        )
        out = oai.chat.completions.create(
            model="vision", messages=messages, max_tokens=8, temperature=0
        )
        return out.choices[0].message.content or ""

    alone = [run(i) for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(run, range(6)))
    assert together == alone


def test_what_is_refused_names_it(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="text", messages=ask(data_url(png(1))), max_tokens=4)
    assert "takes no images" in caught.value.message
    bad = "data:image/png;base64," + base64.b64encode(b"not a png at all").decode()
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="vision", messages=ask(bad), max_tokens=4)
    assert caught.value.body["param"] == "messages[0].content[0].image_url.url"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(
            model="vision", messages=ask("http://127.0.0.1:9/a.png"), max_tokens=4
        )
    # a refused fetch is a 400 naming the part; private addresses are allowed in this
    # gateway, so this one is refused because nothing listens there
    assert caught.value.body["param"] == "messages[0].content[0].image_url.url"  # type: ignore[index]


def test_a_worker_dying_mid_request_gives_one_clear_error(oai: openai.OpenAI) -> None:
    oai.chat.completions.create(model="fragile", messages=ask(data_url(png(20))), max_tokens=2)
    stream = oai.chat.completions.create(
        model="fragile", messages=ask(data_url(png(21)), "CRASH now"), max_tokens=50, stream=True
    )
    with pytest.raises(openai.APIError) as info:
        for _ in stream:
            pass
    assert "worker" in str(info.value).lower()
    # restarted: the next request is served
    again = oai.chat.completions.create(
        model="fragile", messages=ask(data_url(png(22))), max_tokens=2
    )
    assert again.choices[0].message.content is not None


def test_streams_with_images_in_anthropic_and_responses(gw: GatewayProc, images: str) -> None:
    client = anthropic.Anthropic(base_url=gw.base_url, api_key="x", max_retries=0)
    content: Any = [
        {"type": "image", "source": {"type": "url", "url": f"{images}/a.png"}},
        {"type": "text", "text": "Describe it."},
    ]
    with client.messages.stream(
        model="vision",
        max_tokens=6,
        messages=[{"role": "user", "content": content}],
        extra_body={"temperature": 0},
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    usage = final.usage  # Anthropic's input_tokens leaves the cached part out
    assert streamed and usage.input_tokens + (usage.cache_read_input_tokens or 0) > 20
    oai = openai_client(gw)
    events = oai.responses.create(
        model="vision",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(png(3))},
                    {"type": "input_text", "text": "Describe it."},
                ],
            }
        ],
        max_output_tokens=6,
        temperature=0,
        stream=True,
    )
    kinds = [event.type for event in events]
    # max_output_tokens reached: incomplete, as OpenAI says it
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.incomplete"


def test_a_default_gateway_refuses_private_addresses_and_oversized_images(
    vision_model_dir: Path, images: str
) -> None:
    models = [{"name": "vision", "source": str(vision_model_dir)}]
    with running_gateway(models, request_timeout_s=60.0, image_max_bytes=4096) as proc:
        client = openai_client(proc)
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model="vision", messages=ask(f"{images}/a.png"), max_tokens=2
            )
        assert caught.value.body["param"] == "messages[0].content[0].image_url.url"  # type: ignore[index]
        assert "127.0.0.1" in caught.value.message and "private" in caught.value.message
        big = png(4, (400, 300))  # a PNG of random pixels: ~360 kB
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model="vision", messages=ask(data_url(big)), max_tokens=2
            )
        assert "server.image_max_bytes" in caught.value.message
