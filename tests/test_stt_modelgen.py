"""The tiny generated Whisper models load with mlx-audio offline: a scripted one says its
script and detects its language, an English-only one has OpenAI's smaller vocabulary and no
translation, the files are the same for the same seed, and the demo is built once."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shared.config import STT_DEMO_SOURCE, ModelConfig, ModelKind
from shared.modelinfo import kind_in, served_by
from worker.loader import resolve_source
from worker.speech.stt_modelgen import (
    MODEL_FILES,
    TinyWhisperSpec,
    build_tiny_whisper,
    ensure_stt_demo,
    main,
)

SECOND = np.zeros(16000, np.float32)


def load(path: Path) -> Any:
    from mlx_audio.stt import load as stt_load

    return stt_load(path)


def config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The demo model, built into a cache of this module's own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLX_GATEWAY_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield ensure_stt_demo()


def test_the_demo_is_built_once_into_the_cache_and_is_whole(demo: Path) -> None:
    assert demo.name == "demo-whisper-v1" and demo.parent.name == "models"
    assert all((demo / name).is_file() for name in MODEL_FILES)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLX_GATEWAY_CACHE_DIR", str(demo.parent.parent))
        before = (demo / "model.safetensors").stat().st_mtime_ns
        assert ensure_stt_demo() == demo
        assert (demo / "model.safetensors").stat().st_mtime_ns == before  # not rebuilt
        assert resolve_source(ModelConfig("whisper", STT_DEMO_SOURCE)) == demo
        (demo / "tokenizer.json").unlink()  # an incomplete folder is rebuilt
        assert ensure_stt_demo() == demo and (demo / "tokenizer.json").is_file()


def test_a_scripted_model_says_its_script_and_detects_its_language(demo: Path) -> None:
    raw = config(demo)
    assert raw["model_type"] == "whisper" and raw["n_vocab"] == 51865
    assert raw["mlx_gateway_spec"]["scripted"] is True
    model = load(demo)
    assert model.is_multilingual
    result = model.generate(SECOND, temperature=0.0)
    assert (result.text, result.language) == (" hello world", "de")
    [segment] = result.segments
    assert (segment["start"], segment["end"], segment["text"]) == (0.0, 1.0, " hello world")
    given = model.generate(SECOND, temperature=0.0, language="fr", task="translate")
    assert (given.text, given.language) == (" hello world", "fr")


def test_the_folder_says_it_is_a_transcription_model_that_translates(demo: Path) -> None:
    assert kind_in(demo) is ModelKind.TRANSCRIPTION
    assert served_by(ModelConfig("w", str(demo))) == ["transcription", "translation"]


def test_an_english_only_model_has_the_smaller_vocabulary(tmp_path: Path) -> None:
    spec = TinyWhisperSpec(multilingual=False, script=" one two")
    path = build_tiny_whisper(tmp_path / "en", spec=spec)
    assert config(path)["n_vocab"] == 51864
    assert served_by(ModelConfig("w", str(path))) == ["transcription"]
    model = load(path)
    assert not model.is_multilingual
    result = model.generate(SECOND, temperature=0.0)
    assert (result.text, result.language) == (" one two", "en")


def test_the_same_seed_gives_the_same_files_and_the_cli_builds_a_random_one(
    demo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    again = build_tiny_whisper(tmp_path / "again", seed=0, scripted=True)
    for name in MODEL_FILES:
        assert (again / name).read_bytes() == (demo / name).read_bytes(), name
    assert main([str(tmp_path / "random"), "--random", "--seed", "1"]) == 0
    assert "built" in capsys.readouterr().out
    random = tmp_path / "random"
    assert config(random)["mlx_gateway_spec"]["scripted"] is False
    weights = (random / "model.safetensors").read_bytes()
    assert weights != (demo / "model.safetensors").read_bytes()
    result = load(random).generate(
        SECOND, temperature=0.0, compression_ratio_threshold=None, logprob_threshold=None
    )
    assert isinstance(result.text, str) and result.text != " hello world"


def test_a_spec_it_cannot_build_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="language"):
        build_tiny_whisper(tmp_path, spec=TinyWhisperSpec(language="xx"))
    with pytest.raises(ValueError, match="too long"):
        build_tiny_whisper(tmp_path, spec=TinyWhisperSpec(script=" hello" * 40))
