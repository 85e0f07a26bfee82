"""A vision model in one process: the engine over mlx-vlm's Qwen2-VL (a tiny random one).
Its greedy text is mlx-vlm's own; rows with images decode in one batch with text rows as
each would alone; the prefix cache reuses an image's KV only for the same image."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import msgspec
import pytest
from PIL import Image

from shared.config import EngineOptions, ModelConfig
from shared.protocol import Add
from shared.types import (
    AudioPart,
    CanonicalRequest,
    ImagePart,
    Message,
    RequestKind,
    SamplingParams,
    TextPart,
)
from worker.backends.formats import model_formats
from worker.engine.core import EngineCore
from worker.preprocess import PreparedRequest, PreprocessError
from worker.vision.open import open_vision, probe_request, vision_backend, vision_preprocessor
from worker.vision.prompt import VisionPreprocessor

pytest.importorskip("mlx_vlm")


def png(color: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def noise(seed: int, size: tuple[int, int]) -> bytes:
    """An image whose pixels differ everywhere (a flat color says little to a random model)."""
    pixels = mx.random.uniform(shape=(size[1], size[0], 3), key=mx.random.key(seed)) * 255
    buffer = io.BytesIO()
    Image.fromarray(pixels.astype(mx.uint8).__array__()).save(buffer, format="PNG")
    return buffer.getvalue()


RED, GREEN, BLUE = (
    png((255, 0, 0), (100, 80)),
    png((0, 255, 0), (120, 40)),
    png((0, 0, 255), (60, 60)),
)


class Vision:
    def __init__(self, path: Path, prefix_cache: bool = True) -> None:
        engine = EngineOptions(prefix_cache=prefix_cache)
        self.config = ModelConfig(name="vision", source=str(path), engine=engine)
        loaded, processor = open_vision(self.config, path, lambda *_: None)
        self.loaded, self.processor = loaded, processor
        backend = vision_backend(loaded, processor, self.config)
        self.backend = backend
        formats = model_formats(loaded.tokenizer, None)
        self.pre: VisionPreprocessor = vision_preprocessor(loaded, processor, self.config, formats)
        self.engine = EngineCore(backend, self.config.engine)

    def prepare(self, rid: str, turns: list[list[Any]], max_tokens: int = 8) -> PreparedRequest:
        messages = []
        for i, parts in enumerate(turns):
            role = "user" if i % 2 == 0 else "assistant"
            if role == "assistant" or all(isinstance(p, str) for p in parts):
                messages.append(Message(role, "".join(parts)))
                continue
            content = [TextPart(p) if isinstance(p, str) else ImagePart(p) for p in parts]
            text = "".join(p for p in parts if isinstance(p, str))
            messages.append(Message(role, text, parts=content))
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return self.pre(Add(rid, RequestKind.CHAT, CanonicalRequest(messages=messages), sampling))

    def run(self, prepared: list[PreparedRequest]) -> dict[str, tuple[str, int]]:
        """Each request's text and cached prompt tokens."""
        for p in prepared:
            self.engine.add(p)
        texts = {p.request_id: "" for p in prepared}
        cached: dict[str, int] = {}
        for _ in range(500):
            if not self.engine.has_work:
                break
            for out in self.engine.step():
                assert out.error is None, out.error
                texts[out.request_id] += out.text
                if out.finish_reason is not None:
                    assert out.usage is not None
                    cached[out.request_id] = out.usage.cached_tokens
        assert not self.engine.has_work
        return {rid: (texts[rid], cached[rid]) for rid in texts}


@pytest.fixture(scope="module")
def vision(vision_model_dir: Path) -> Iterator[Vision]:
    yield Vision(vision_model_dir)


def test_greedy_text_is_mlx_vlms_own(vision: Vision) -> None:
    from mlx_vlm import generate

    from worker.vision.prompt import decode

    prepared = vision.prepare("a", [[RED, "What is in the picture?"]], max_tokens=10)
    ours = vision.run([prepared])["a"][0]
    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}],
        }
    ]
    text = vision.loaded.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    image = decode(ImagePart(RED), "x")
    reference = generate(
        vision.loaded.model.vlm,
        vision.processor,
        text,
        image=[image],
        max_tokens=10,
        temperature=0.0,
        verbose=False,
    )
    assert ours and ours == reference.text


def test_image_rows_and_text_rows_in_one_batch_decode_as_alone(vision: Vision) -> None:
    turns = {
        "one": [[RED, "Describe it."]],
        "text": [["Tell me a story about a lighthouse."]],
        "two": [[GREEN, "and", BLUE, "Compare them."]],
        "noisy": [[noise(1, (90, 70)), "What now?"]],
    }
    alone = {}
    for rid, t in turns.items():
        vision.engine.prefix_cache.clear()
        alone.update(vision.run([vision.prepare(rid, t)]))
    vision.engine.prefix_cache.clear()
    together = vision.run([vision.prepare(rid, t) for rid, t in turns.items()])
    assert {k: v[0] for k, v in together.items()} == {k: v[0] for k, v in alone.items()}
    assert all(v[0] for v in together.values())


def test_the_same_image_reuses_its_kv_and_another_does_not(vision: Vision) -> None:
    vision.engine.prefix_cache.clear()
    first = vision.prepare("a", [[noise(2, (100, 80)), "Describe it."]])
    cold = vision.run([first])["a"]
    again = vision.prepare("a", [[noise(2, (100, 80)), "Describe it."]])
    warm = vision.run([again])["a"]
    assert warm[0] == cold[0] and warm[1] == len(again.prompt) - 1
    # same size, same text, other pixels: nothing after the image's first token is reused
    other = vision.prepare("b", [[noise(3, (100, 80)), "Describe it."]])
    assert other.prompt == again.prompt  # the token ids alone cannot tell them apart
    image_at = other.prompt.index(vision.loaded.model.image_token)
    assert vision.run([other])["b"][1] <= image_at


def test_a_next_turn_reuses_the_image_and_answers_as_without_the_cache(
    vision: Vision, vision_model_dir: Path
) -> None:
    image = noise(4, (80, 80))
    vision.engine.prefix_cache.clear()
    turn1 = vision.prepare("t1", [[image, "What is it?"]])
    answer = vision.run([turn1])["t1"][0]
    turns = [[image, "What is it?"], [answer], ["And its colour?"]]
    turn2 = vision.run([vision.prepare("t2", turns)])["t2"]
    assert turn2[1] >= len(turn1.prompt) - 1
    cold = Vision(vision_model_dir, prefix_cache=False)
    assert cold.run([cold.prepare("t2", turns)])["t2"][0] == turn2[0]


def test_an_image_reaches_the_model(vision: Vision) -> None:
    """Different images, the same tokens: the first logits differ."""
    logits = []
    for data in (noise(5, (100, 80)), noise(6, (100, 80))):
        prepared = vision.prepare("x", [[data, "Hi"]])
        cache, shift = vision.backend.prefill(prepared.prompt, prepared.media, None, 0)
        last = mx.array([[prepared.prompt[-1]]])
        logits.append(vision.loaded.model(last, cache=cache, shifts=mx.array([shift])))
    assert not mx.allclose(logits[0], logits[1]).item()


def test_the_probe_and_what_a_vision_worker_refuses(vision: Vision) -> None:
    vision.engine.probe(prepared=probe_request(vision.pre))
    message = Message("user", "hi", parts=[TextPart("hi"), AudioPart(b"RIFF", format="wav")])
    frame = Add("x", RequestKind.CHAT, CanonicalRequest(messages=[message]), SamplingParams())
    with pytest.raises(PreprocessError) as caught:
        vision.pre(frame)
    assert caught.value.error.param == "messages[0].content[1]"
    bad = Message(
        "user", "hi", parts=[ImagePart(b"GIF89a...", where="messages[0].content[0].image_url.url")]
    )
    frame = Add("y", RequestKind.CHAT, CanonicalRequest(messages=[bad]), SamplingParams())
    with pytest.raises(PreprocessError) as caught:
        vision.pre(frame)
    assert caught.value.error.param == "messages[0].content[0].image_url.url"


def test_a_prompt_the_model_refuses_fails_alone_and_the_engine_goes_on(vision: Vision) -> None:
    """Text that spells the image token makes more image tokens than the image has features:
    the model raises at prefill; that request gets a 400, its neighbour its answer."""
    bad = vision.prepare("bad", [[noise(7, (100, 80)), "look <|placeholder|><|placeholder|>"]])
    good = vision.prepare("good", [[noise(8, (100, 80)), "Describe it."]])
    vision.engine.add(bad)
    vision.engine.add(good)
    outputs: dict[str, list[Any]] = {}
    for _ in range(200):
        if not vision.engine.has_work:
            break
        for out in vision.engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    [refused] = outputs["bad"]
    assert refused.error is not None and refused.error.param == "messages"
    assert "images" in refused.error.message
    assert outputs["good"][-1].finish_reason is not None and outputs["good"][-1].error is None
    assert not vision.engine.has_work and vision.engine.counts() == (0, 0)


def test_low_detail_is_another_image_for_the_cache(vision: Vision) -> None:
    vision.engine.prefix_cache.clear()
    data = noise(9, (1200, 900))
    vision.run([vision.prepare("high", [[data, "Describe it."]])])
    messages = [
        Message(
            "user", "Describe it.", parts=[ImagePart(data, detail="low"), TextPart("Describe it.")]
        )
    ]
    sampling = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    low = vision.pre(Add("low", RequestKind.CHAT, CanonicalRequest(messages=messages), sampling))
    image_at = low.prompt.index(vision.loaded.model.image_token)
    assert vision.run([low])["low"][1] <= image_at


def test_counting_tokens_leaves_nothing_for_the_next_request(vision: Vision) -> None:
    messages = [Message("user", "Hi", parts=[ImagePart(noise(10, (100, 80))), TextPart("Hi")])]
    args = {"kind": "chat", "request": CanonicalRequest(messages=messages)}
    counted = vision.pre.tokenize_call(msgspec.to_builtins(args))["count"]
    again = vision.pre.tokenize_call(msgspec.to_builtins(args))["count"]
    assert counted == again
    assert vision.pre._images == [] and vision.pre._media is None
    text_only = vision.prepare("t", [["Just text."]])
    assert text_only.media is None and text_only.key is None
