"""The tiny generated Qwen2-VL model loads and generates with mlx_vlm, offline."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

mlx_vlm = pytest.importorskip("mlx_vlm")

import mlx.core as mx  # noqa: E402
from PIL import Image  # noqa: E402

from worker.modelgen import is_printable_text  # noqa: E402
from worker.vision import modelgen  # noqa: E402
from worker.vision.modelgen import (  # noqa: E402
    IM_END_ID,
    IMAGE_PAD,
    IMAGE_PAD_ID,
    SPECIAL_TOKENS,
    VISION_END_ID,
    VISION_START_ID,
    TinyVisionSpec,
    build_tiny_vision_model,
    image_tokens,
)

# (width, height) -> image tokens with the default 56*56 .. 112*112 pixel bounds.
SIZES = {(64, 48): 4, (100, 80): 12, (4000, 3000): 12, (10, 10): 4}
TWO_IMAGES = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "Compare"},
            {"type": "image"},
            {"type": "text", "text": "and"},
            {"type": "image"},
        ],
    }
]
TEXT_ONLY = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vision_model(tmp_path_factory.mktemp("qwen2vl"), seed=0)


@pytest.fixture(scope="module")
def loaded(model_dir: Path) -> tuple[Any, Any]:
    model, processor = mlx_vlm.load(str(model_dir))
    return model, processor


def _images() -> list[Image.Image]:
    return [Image.new("RGB", (64, 48), (255, 0, 0)), Image.new("RGB", (100, 80), (0, 0, 255))]


def _hashes(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def _printable(text: str) -> bool:
    return text == "" or is_printable_text(text)


def test_files_and_config(model_dir: Path) -> None:
    for name in modelgen.MODEL_FILES:
        assert (model_dir / name).is_file(), name
    assert sum(p.stat().st_size for p in model_dir.iterdir()) < 3_000_000
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2_vl"
    assert config["eos_token_id"] == IM_END_ID == 2
    assert config["image_token_id"] == IMAGE_PAD_ID
    assert config["vision_start_token_id"] == VISION_START_ID
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tokenizer["added_tokens"] if t["special"]}
    assert added == {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    assert (
        json.loads((model_dir / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"
    )


def test_same_seed_same_files(model_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_vision_model(tmp_path / "again", seed=0)
    assert _hashes(again) == _hashes(model_dir)
    other = build_tiny_vision_model(tmp_path / "other", seed=1)
    assert _hashes(other)["model.safetensors"] != _hashes(model_dir)["model.safetensors"]
    assert _hashes(other)["tokenizer.json"] == _hashes(model_dir)["tokenizer.json"]


def test_loads(loaded: tuple[Any, Any]) -> None:
    model, processor = loaded
    assert model.config.model_type == "qwen2_vl"
    assert processor.tokenizer.eos_token_id == IM_END_ID
    assert processor.image_token_id == IMAGE_PAD_ID
    assert processor.tokenizer.convert_tokens_to_ids(IMAGE_PAD) == IMAGE_PAD_ID


def test_loads_without_the_hub(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file mlx-vlm looks for is in the folder: it never asks the Hub, even by a
    relative path (which would pass for a repo id)."""
    import huggingface_hub

    def no_hub(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"Hub lookup: {args} {kwargs}")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_hub)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    monkeypatch.setattr(mlx_vlm.utils, "snapshot_download", no_hub)
    monkeypatch.chdir(model_dir.parent)
    model, _ = mlx_vlm.load(model_dir.name)
    assert model.config.model_type == "qwen2_vl"


def test_image_tokens_per_image(loaded: tuple[Any, Any]) -> None:
    _, processor = loaded
    prompt = processor.apply_chat_template(TWO_IMAGES, add_generation_prompt=True, tokenize=False)
    assert prompt.count(IMAGE_PAD) == 2
    inputs = mlx_vlm.prepare_inputs(processor, images=_images(), prompts=prompt)
    ids: list[int] = inputs["input_ids"][0].tolist()
    grid = inputs["image_grid_thw"].tolist()
    per_grid = [t * h * w // 4 for t, h, w in grid]  # merge size 2 x 2
    starts = [i for i, t in enumerate(ids) if t == VISION_START_ID]
    ends = [i for i, t in enumerate(ids) if t == VISION_END_ID]
    runs = [ids[s + 1 : e] for s, e in zip(starts, ends, strict=True)]
    assert [len(r) for r in runs] == per_grid == [4, 12]
    assert all(set(r) == {IMAGE_PAD_ID} for r in runs)
    assert ids.count(IMAGE_PAD_ID) == sum(per_grid)
    assert [image_tokens(*im.size) for im in _images()] == per_grid
    one_image = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}]
    prompt = processor.apply_chat_template(one_image, add_generation_prompt=True, tokenize=False)
    for (w, h), n in SIZES.items():
        assert image_tokens(w, h) == n, (w, h)
        one = mlx_vlm.prepare_inputs(processor, images=[Image.new("RGB", (w, h))], prompts=prompt)
        assert int(one["image_grid_thw"].prod()) // 4 == n, (w, h)


def test_embeddings_and_language_model(loaded: tuple[Any, Any]) -> None:
    model, processor = loaded
    prompt = processor.apply_chat_template(TWO_IMAGES, add_generation_prompt=True, tokenize=False)
    inputs = mlx_vlm.prepare_inputs(processor, images=_images(), prompts=prompt)
    features = model.get_input_embeddings(
        inputs["input_ids"],
        inputs["pixel_values"],
        mask=inputs["attention_mask"],
        image_grid_thw=inputs["image_grid_thw"],
    )
    length = inputs["input_ids"].shape[1]
    assert features.inputs_embeds.shape == (1, length, model.config.text_config.hidden_size)
    out = model.language_model(
        inputs["input_ids"],
        inputs_embeds=features.inputs_embeds,
        position_ids=features.position_ids,
    )
    assert out.logits.shape == (1, length, model.config.text_config.vocab_size)
    assert bool(mx.isfinite(out.logits).all())


@pytest.mark.parametrize("with_images", [True, False], ids=["two-images", "text-only"])
def test_generate(loaded: tuple[Any, Any], with_images: bool) -> None:
    model, processor = loaded
    messages = TWO_IMAGES if with_images else TEXT_ONLY
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    images = _images() if with_images else None
    result = mlx_vlm.generate(
        model, processor, prompt, image=images, max_tokens=6, temperature=0.0, verbose=False
    )
    assert result.generation_tokens > 0
    inputs = mlx_vlm.prepare_inputs(processor, images=images, prompts=prompt)
    assert result.prompt_tokens == inputs["input_ids"].shape[1]
    assert _printable(result.text), repr(result.text)
    again = mlx_vlm.generate(
        model, processor, prompt, image=images, max_tokens=6, temperature=0.0, verbose=False
    )
    assert again.text == result.text


def test_every_token_decodes_printable(loaded: tuple[Any, Any]) -> None:
    _, processor = loaded
    tokenizer = processor.tokenizer
    for i in range(len(SPECIAL_TOKENS), len(tokenizer)):
        assert is_printable_text(tokenizer.decode([i])), i


def test_spec_validation(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="head dim"):
        build_tiny_vision_model(tmp_path, spec=TinyVisionSpec(hidden_size=24, num_heads=4))
    with pytest.raises(ValueError, match="min_pixels"):
        build_tiny_vision_model(tmp_path, spec=TinyVisionSpec(min_pixels=100))


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert modelgen.main([str(tmp_path / "cli"), "--seed", "3"]) == 0
    assert "built" in capsys.readouterr().out
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert config["mlx_gateway_spec"]["seed"] == 3
