"""What a sharded model's folder must allow: heads, key-value heads and the MLP size that
divide by the shard count (mlx-lm splits them without checking, and three heads over two
ranks gives wrong tokens without an error)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worker.loader import LoadError, check_shardable


def folder(tmp_path: Path, **config: int) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_sizes_that_divide_pass(tmp_path: Path) -> None:
    path = folder(tmp_path, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336)
    check_shardable(path, 2)
    check_shardable(path, 8)


@pytest.mark.parametrize(
    ("config", "shards", "named"),
    [
        ({"num_attention_heads": 3, "intermediate_size": 128}, 2, "num_attention_heads"),
        (
            {"num_attention_heads": 4, "num_key_value_heads": 1, "intermediate_size": 128},
            2,
            "num_key_value_heads",
        ),
        ({"num_attention_heads": 4, "intermediate_size": 100}, 3, "num_attention_heads"),
        ({"num_attention_heads": 4, "intermediate_size": 130}, 4, "intermediate_size"),
        ({"intermediate_size": 128}, 2, "num_attention_heads"),
    ],
)
def test_what_does_not_divide_is_named(
    tmp_path: Path, config: dict[str, int], shards: int, named: str
) -> None:
    with pytest.raises(LoadError, match=named):
        check_shardable(folder(tmp_path, **config), shards)


def test_a_text_config_inside_is_read_and_a_missing_file_says_so(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"text_config": {"num_attention_heads": 6, "intermediate_size": 64}})
    )
    with pytest.raises(LoadError, match="num_attention_heads"):
        check_shardable(tmp_path, 4)
    with pytest.raises(LoadError, match="cannot read"):
        check_shardable(tmp_path / "nowhere", 2)


def test_a_pipeline_needs_a_layer_a_rank_and_the_weights_index(tmp_path: Path) -> None:
    # heads that do not divide do not matter to a pipeline: each rank runs whole layers
    path = folder(tmp_path, num_attention_heads=3, num_hidden_layers=3, intermediate_size=7)
    with pytest.raises(LoadError, match=r"model\.safetensors\.index\.json"):
        check_shardable(path, 2, "pipeline")
    (path / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    check_shardable(path, 2, "pipeline")
    check_shardable(path, 3, "pipeline")
    with pytest.raises(LoadError, match="as many layers"):
        check_shardable(path, 4, "pipeline")
