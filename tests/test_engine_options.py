"""A model's engine settings alone: what makes a set of them wrong names the setting (the
config loader adds the model's name; test_config.py goes through the TOML file)."""

from __future__ import annotations

import math

import pytest

from shared.engine_options import EngineOptions, GiB, engine_problem, prefix_cache_bytes


def test_the_defaults_are_a_valid_set() -> None:
    assert engine_problem(EngineOptions()) is None


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"max_running": 0}, "engine.max_running must be at least 1"),
        ({"batch_share": 1.5}, "engine.batch_share"),
        ({"max_waiting": -1}, "engine.max_waiting"),
        ({"prefix_cache_gb": math.inf}, "engine.prefix_cache_gb"),
        ({"kv_memory_gb": 0.0}, "engine.kv_memory_gb"),
        ({"batcher": "mlx_lm", "decode_step": "compiled"}, "engine.decode_step = 'compiled'"),
        ({"batcher": "mlx_lm", "join_settle_steps": 2}, "engine.join_settle_steps applies"),
        ({"decode_step": "model", "decode_attention": "kernel"}, "engine.decode_attention"),
        ({"decode_step": "model", "decode_projections": "stacked"}, "engine.decode_projections"),
        ({"first_token": "step", "prefill_attention": "kernel"}, "engine.prefill_attention"),
        ({"batcher": "mlx_lm", "prefill_attention": "mlx"}, "engine.prefill_attention"),
    ],
)
def test_a_wrong_setting_is_named(fields: dict[str, object], named: str) -> None:
    problem = engine_problem(EngineOptions(**fields))  # type: ignore[arg-type]
    assert problem is not None and named in problem


@pytest.mark.parametrize(
    ("fields", "device_gib", "bound_gib"),
    [
        ({}, 16, 2),  # an eighth is less than the floor
        ({}, 48, 6),  # a 64 GB Mac's working set
        ({}, 80, 10),  # an H100
        ({"prefix_cache_gb": 0.5}, 80, 0.5),  # set: whatever the device
        ({"prefix_cache_gb": 0.0}, 80, 0),
        ({"prefix_cache": False}, 80, 0),
        ({"prefix_cache": False, "prefix_cache_gb": 4.0}, 80, 0),
    ],
)
def test_the_prefix_cache_bound(
    fields: dict[str, object], device_gib: int, bound_gib: float
) -> None:
    options = EngineOptions(**fields)  # type: ignore[arg-type]
    assert prefix_cache_bytes(options, device_gib * GiB) == int(bound_gib * GiB)
