"""The servers an agent-session benchmark can measure (benchmarks/agent_session.py): the
peers launched by default and the gateway's configurations, each an engine section of its
config and, where it needs one, an environment beside the run's."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.blas import CUDNN_SDPA

SOURCES = ("gateway", "gateway-nocache", "mlx_lm", "vllm_mlx")  # launched by default
# "gateway" and "gateway-nocache" keep BatchGenerator (the tables measured so far), the rows
# batch (the default now) is "gateway-rows" ("gateway-rows-nocache" without the prefix cache,
# "gateway-rows-whole" with every prompt tokenized whole: engine.segment_tokens = false;
# "gateway-rows-buckets" and "gateway-rows-nocache-buckets" with engine.prefill_shapes =
# "buckets"; "gateway-rows-stepfirst" with engine.first_token = "step", mlx-lm's way;
# "gateway-rows-early" and "gateway-rows-nocache-early" with engine.first_token_read =
# "early", a lone request's first token read before the next step is built;
# "gateway-rows-mlxattn" and "gateway-rows-nocache-mlxattn" with engine.prefill_attention =
# "mlx", MLX's attention in the prefill instead of the project's kernel;
# "gateway-rows-cudnn" and "gateway-rows-nocache-cudnn" with MLX's CUDA backend on cuDNN's
# attention, which workers leave off by default: GATEWAY_ENV).
GATEWAY_ENGINE: dict[str, dict[str, bool | int | float | str]] = {
    "gateway": {"prefix_cache": True, "batcher": "mlx_lm"},
    "gateway-nocache": {"prefix_cache": False, "batcher": "mlx_lm"},
    "gateway-rows": {"prefix_cache": True, "batcher": "rows"},
    "gateway-rows-nocache": {"prefix_cache": False, "batcher": "rows"},
    "gateway-rows-whole": {"prefix_cache": True, "batcher": "rows", "segment_tokens": False},
    "gateway-rows-buckets": {"prefix_cache": True, "batcher": "rows", "prefill_shapes": "buckets"},
    "gateway-rows-nocache-buckets": {
        "prefix_cache": False,
        "batcher": "rows",
        "prefill_shapes": "buckets",
    },
    "gateway-rows-stepfirst": {"prefix_cache": True, "batcher": "rows", "first_token": "step"},
    "gateway-rows-early": {"prefix_cache": True, "batcher": "rows", "first_token_read": "early"},
    "gateway-rows-nocache-early": {
        "prefix_cache": False,
        "batcher": "rows",
        "first_token_read": "early",
    },
    "gateway-rows-mlxattn": {"prefix_cache": True, "batcher": "rows", "prefill_attention": "mlx"},
    "gateway-rows-nocache-mlxattn": {
        "prefix_cache": False,
        "batcher": "rows",
        "prefill_attention": "mlx",
    },
}
# the environment a source's gateway (and so its workers) gets beside the run's: a "-cudnn"
# source is its plain one's configuration on cuDNN's attention
GATEWAY_ENV: dict[str, dict[str, str]] = {}
for _plain in ("gateway-rows", "gateway-rows-nocache"):
    GATEWAY_ENGINE[f"{_plain}-cudnn"] = GATEWAY_ENGINE[_plain]
    GATEWAY_ENV[f"{_plain}-cudnn"] = {CUDNN_SDPA: "1"}
GATEWAY_MODEL_NAME = "bench"
# every source --sources accepts: the default ones, then the other gateway configurations
KNOWN = (*SOURCES, *(name for name in GATEWAY_ENGINE if name not in SOURCES))


@dataclass
class Source:
    """One server to measure: running at ``url``, or launched from ``command``."""

    name: str
    url: str | None = None
    command: str | None = None
    model_id: str | None = None
    engine: dict[str, bool | int | float | str] = field(default_factory=dict)
    ignore_eos: bool = False
    env: dict[str, str] = field(default_factory=dict)  # beside the run's environment
