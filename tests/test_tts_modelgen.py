"""The tiny generated Qwen3-TTS loads with mlx-audio offline: its voices and languages, 2 kHz
noise within full scale, generation that always ends, streaming in chunks; the same seed gives
the same files; a bad spec is refused; the demo is built once into the cache."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shared.config import TTS_DEMO_SOURCE, ModelConfig, ModelKind
from shared.modelinfo import kind_in, served_by
from worker.loader import resolve_source
from worker.speech.tts_modelgen import (
    DEFAULT_TTS_SPEC,
    FRAME_RATE,
    MODEL_FILES,
    TinyTTSSpec,
    build_tiny_tts,
    ensure_tts_demo,
    main,
)


def load(path: Path) -> Any:
    from mlx_audio.tts.utils import load_model  # a local folder: nothing to fetch

    return load_model(path)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The demo model, built into a cache of this module's own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLX_GATEWAY_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield ensure_tts_demo()


@pytest.fixture(scope="module")
def model(demo: Path) -> Any:
    return load(demo)


def test_the_demo_is_built_once_into_the_cache_and_is_whole(demo: Path) -> None:
    assert demo.name == "demo-qwen3-tts-v1" and demo.parent.name == "models"
    assert all((demo / name).is_file() for name in MODEL_FILES)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLX_GATEWAY_CACHE_DIR", str(demo.parent.parent))
        before = (demo / "model.safetensors").stat().st_mtime_ns
        assert ensure_tts_demo() == demo
        assert (demo / "model.safetensors").stat().st_mtime_ns == before  # not rebuilt
        assert resolve_source(ModelConfig("tts", TTS_DEMO_SOURCE)) == demo
    assert kind_in(demo) is ModelKind.SPEECH
    assert served_by(ModelConfig("tts", str(demo))) == ["speech"]


def test_the_same_seed_gives_the_same_files(demo: Path, tmp_path: Path) -> None:
    again = build_tiny_tts(tmp_path / "again", seed=0)
    for name in MODEL_FILES:
        assert (again / name).read_bytes() == (demo / name).read_bytes(), name
    other = build_tiny_tts(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (demo / "model.safetensors").read_bytes()


def test_it_loads_with_its_voices_languages_and_rate(demo: Path, model: Any) -> None:
    config = json.loads((demo / "config.json").read_text())
    assert config["model_type"] == "qwen3_tts" and config["tts_model_type"] == "custom_voice"
    assert model.get_supported_speakers() == list(DEFAULT_TTS_SPEC.voices)
    assert model.get_supported_languages() == ["auto", *DEFAULT_TTS_SPEC.languages]
    assert model.sample_rate == DEFAULT_TTS_SPEC.sample_rate == 2000
    assert model.speech_tokenizer is not None and model.tokenizer is not None


def test_generation_ends_within_its_frames_with_noise_in_full_scale(model: Any) -> None:
    per_frame = int(DEFAULT_TTS_SPEC.sample_rate / FRAME_RATE)
    for voice in DEFAULT_TTS_SPEC.voices:
        results = list(model.generate("Hello there, how are you?", voice=voice))
        audio = np.concatenate([np.asarray(r.audio, np.float32) for r in results])
        frames = sum(r.token_count for r in results)
        assert 0 < frames <= DEFAULT_TTS_SPEC.max_new_tokens
        assert 0 < audio.size <= frames * per_frame
        assert np.isfinite(audio).all() and 0.001 < np.abs(audio).max() < 1.0  # not clipped


def test_it_streams_in_chunks_that_join_into_the_whole(model: Any) -> None:
    import mlx.core as mx

    mx.random.seed(3)
    whole = [np.asarray(r.audio) for r in model.generate("Hi.", voice="echo")]
    mx.random.seed(3)
    chunks = list(model.generate("Hi.", voice="echo", stream=True, streaming_interval=0.16))
    assert len(whole) == 1 and len(chunks) >= 3
    assert all(c.is_streaming_chunk for c in chunks)
    joined = np.concatenate([np.asarray(c.audio) for c in chunks])
    assert joined.shape == whole[0].shape
    assert np.abs(joined - whole[0]).max() < 1e-2  # the streaming vocoder's is the same audio


def test_a_spec_mlx_audio_could_not_read_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiple of 50"):
        build_tiny_tts(tmp_path, spec=TinyTTSSpec(sample_rate=2010))
    with pytest.raises(ValueError, match="needs decoder_dim over 320"):
        build_tiny_tts(tmp_path, spec=TinyTTSSpec(sample_rate=8000))
    with pytest.raises(ValueError, match="over 128"):
        build_tiny_tts(tmp_path, spec=TinyTTSSpec(decoder_dim=128, sample_rate=1000))
    with pytest.raises(ValueError, match="voices"):
        build_tiny_tts(tmp_path, spec=TinyTTSSpec(voices=("a", "a")))
    assert not (tmp_path / "config.json").exists()


def test_the_command_line_builds_a_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cli"
    assert main([str(out), "--voices", "ash, coral", "--max-new-tokens", "4"]) == 0
    assert f"built {out}" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert list(config["talker_config"]["spk_id"]) == ["ash", "coral"]
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["max_new_tokens"] == 4
