"""A model's engine settings (`[models.engine]`): what its worker's scheduler, batch and
decode step do, sent to the worker at spawn, and what makes a set of them wrong."""

from __future__ import annotations

import math
from typing import Literal

import msgspec


class EngineOptions(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Per-model engine settings, sent to the worker at spawn."""

    max_running: int = 64
    max_waiting: int = 256
    prefill_batch_size: int = 8
    prefill_step_size: int = 512
    max_context: int | None = None
    default_max_tokens: int | None = None
    # Prompt tokens the scheduler hands to prefill in one engine step (new tokens: a cached
    # prefix is not counted). A burst larger than this starts over several steps, the first
    # requests streaming while the rest prefill; one prompt longer than it goes in alone.
    max_prefill_tokens: int = 8192
    # Memory for running requests' KV cache, in GiB: a request is admitted while the KV of
    # the running requests (as long as each is now) plus its prompt and up to 256 tokens of
    # its output fits (worker/engine/scheduler.py). Default: what the device has left after
    # the weights and the prefix cache, less a tenth.
    kv_memory_gb: float | None = None
    # Reuse of earlier requests' KV: a prompt that shares a prefix with one seen before
    # prefills only the rest. Bounded in bytes (least recently used out first) and counted
    # in the gateway's memory budget. Default bound: an eighth of the device's memory, at
    # least 2 GiB (prefix_cache_bytes).
    prefix_cache: bool = True
    prefix_cache_gb: float | None = None
    # Chat prompts tokenized by segments (the text between special tokens), each segment's
    # tokens kept for the next turn, so a turn encodes only its new messages
    # (worker/prompt_segments.py; checked equal to the whole encoding at load, and off where
    # it is not). False: every prompt is encoded whole.
    segment_tokens: bool = True
    # The bound of MLX's buffer cache (freed buffers kept for reuse), in GiB; the worker also
    # hands it back once the model has been idle for 2 s. Default: on a Mac the smaller of
    # 4 GiB and an eighth of the recommended working set; elsewhere MLX's own default.
    buffer_cache_gb: float | None = None
    # Batch-priority requests (keys with priority = "batch") may fill at most this share of
    # max_running, so that an interactive request always finds a free place in the batch.
    batch_share: float = 0.75
    # Prompt tokens after templating; default: server.max_prompt_tokens (then no limit but
    # the context length).
    max_prompt_tokens: int | None = None
    # On MLX's CPU device (Linux), swap the model's RMSNorm and RoPE modules for ones that
    # compute the same values with fewer, fused ops (worker/cpu_ops.py). No effect on GPUs.
    fused_cpu_ops: bool = True
    # The continuous batch: "rows" (the project's own, worker/backends/rows.py: rows join
    # and leave the batch without passes of their own), "mlx_lm" (mlx-lm's BatchGenerator),
    # or "auto": rows where the model's layers all keep a plain KV cache, else mlx_lm.
    batcher: Literal["auto", "mlx_lm", "rows"] = "auto"
    # Rows batch only: into a large batch, a group of requests big enough to start waits
    # until this many steps pass without a new arrival (the rest of a wave of returning
    # clients), at most as long as a small group waits. 0: it starts at once. Experimental:
    # not measured served yet (docs/benchmarks.md).
    join_settle_steps: int = 0
    # Rows batch only: how a decode step runs the model. "model": mlx-lm's forward pass.
    # "compiled": the project's own one-token step for Llama-family models (llama, mistral,
    # qwen2, qwen3; worker/backends/decode_step.py: compiled layers over the model's own
    # weights, the same tokens; other models keep mlx-lm's forward pass). "auto": compiled
    # where it was measured faster (MLX's CUDA backend and its CPU; docs/benchmarks.md),
    # mlx-lm's forward pass on Metal, where it has not been measured yet.
    decode_step: Literal["auto", "model", "compiled"] = "auto"
    # The compiled step's attention over rows of different lengths: "mlx" (with a mask),
    # "kernel" (worker/backends/ragged_attention.py: no mask; MLX's CUDA backend only,
    # elsewhere "mlx", logged) or "auto" (the kernel on MLX's CUDA backend, measured faster).
    decode_attention: Literal["auto", "kernel", "mlx"] = "auto"
    # The compiled step's projections: "separate" (each its own multiplication), or
    # "stacked": each layer's Q/K/V and gate/up projections one matrix each, fewer kernels a
    # step (the model's layers read slices of them: no second copy). Opt-in until measured
    # served on a GPU (docs/benchmarks.md).
    decode_projections: Literal["separate", "stacked"] = "separate"
    # Rows batch only: the shapes a prefill runs at. "exact": its prompts' own lengths, its
    # attention over exactly the positions before. "buckets": tokens padded at the end and
    # attention run over positions rounded up to a few sizes (worker/backends/
    # prefill_buckets.py), the same KV: shapes a GPU has met before, where a new one costs a
    # plan and a graph. "auto": buckets on MLX's CUDA backend (measured: first tokens of
    # cached agent turns 1.1-1.5x sooner; docs/benchmarks.md), exact elsewhere (slower on a
    # CPU, not measured on Metal).
    prefill_shapes: Literal["auto", "exact", "buckets"] = "auto"
    # Rows batch only: where a request's first token comes from. "prefill": the output head
    # over its prompt's last position in its own prefill (Llama-family models, as the
    # compiled step: worker/backends/groups.py); the request joins the batch with it, a step
    # sooner. "step": its prompt's last token fed to the batch's next decode step, as mlx-lm
    # does. "auto": prefill where it was measured sooner (MLX's CUDA backend and its CPU;
    # docs/benchmarks.md), step on Metal, where it has not been measured yet.
    first_token: Literal["auto", "prefill", "step"] = "auto"
    # Rows batch, first tokens from the prefill: when the first token of a request that
    # starts in an idle batch (no other row decoding) is read. "pipelined": once the batch's
    # next decode step is built, as every later token is (the host builds step n+1 while the
    # device runs step n). "early": as soon as its prefill is done, before that step is
    # built: the step's host time comes off the first token and onto the second. Opt-in
    # until measured served on a GPU (docs/benchmarks.md: a cached agent turn's next step
    # ran on the device before its first token was read).
    first_token_read: Literal["pipelined", "early"] = "pipelined"
    # Rows batch, first tokens from the prefill: a prefill's attention over several queries.
    # "mlx": the model's own layers, MLX's attention with a mask (on MLX's CUDA backend a
    # product, the mask, a softmax and a second product a layer, off cuDNN's). "kernel": one
    # tensor-core kernel of the project's, no mask (worker/backends/prefill_attention.py;
    # MLX's CUDA backend only, heads of a multiple of 32 dimensions up to 128, bfloat16 or
    # float16; elsewhere "mlx", logged). "auto": the kernel on MLX's CUDA backend for heads
    # of 64 or 128 dimensions, where it was measured faster (docs/benchmarks.md).
    prefill_attention: Literal["auto", "kernel", "mlx"] = "auto"
    # The model's tool-call format: the name of one of mlx-lm's tool parsers
    # (mlx_lm/tool_parsers: json_tools, qwen3_coder, mistral, pythonic, glm47, ...).
    # Default: the one mlx-lm infers from the model's chat template, if any.
    tool_parser: str | None = None
    # A strict tool (strict: true) under tool_choice auto, on a model whose call format
    # cannot be constrained (pythonic, glm47, gemma4, ...): "enforce" refuses the request
    # with a 400 naming `tools`; "best_effort" serves it with its calls parsed as the model
    # writes them, unchecked (for clients that send strict by default, as the OpenAI
    # Agents SDK does). Formats that can be constrained always are.
    strict_tools: Literal["enforce", "best_effort"] = "enforce"


GiB = 1 << 30
# The prefix cache's default bound: a share of the device's memory (what its KV may take
# beside the weights and running requests' KV), and a floor that holds a long agent prompt of
# a small model. On an 8B model (128 KiB of KV a token) a 30k-token prompt takes 3.75 GiB:
# with a 64 GB Mac's 48 GiB working set the default holds 48k tokens, on an 80 GB GPU 80k.
PREFIX_CACHE_DEVICE_SHARE = 8
PREFIX_CACHE_MIN_BYTES = 2 * GiB


def prefix_cache_bytes(opts: EngineOptions, device_bytes: int) -> int:
    """The prefix cache's bound in bytes on a device of ``device_bytes``: 0 when it is off,
    `prefix_cache_gb` when set, else an eighth of the device, at least 2 GiB."""
    if not opts.prefix_cache:
        return 0
    if opts.prefix_cache_gb is not None:
        return int(opts.prefix_cache_gb * GiB)
    return max(PREFIX_CACHE_MIN_BYTES, device_bytes // PREFIX_CACHE_DEVICE_SHARE)


def engine_problem(opts: EngineOptions) -> str | None:
    """What is wrong with these settings (naming the setting), or None."""
    positive = {
        "max_running": opts.max_running,
        "prefill_batch_size": opts.prefill_batch_size,
        "prefill_step_size": opts.prefill_step_size,
        "max_context": opts.max_context or 1,
        "default_max_tokens": opts.default_max_tokens or 1,
        "max_prefill_tokens": opts.max_prefill_tokens,
    }
    for key, value in positive.items():
        if value < 1:
            return f"engine.{key} must be at least 1"
    if not 0 < opts.batch_share <= 1:
        return "engine.batch_share must be in (0, 1]"
    if opts.max_prompt_tokens is not None and opts.max_prompt_tokens < 1:
        return "engine.max_prompt_tokens must be >= 1"
    if opts.max_waiting < 0:
        return "engine.max_waiting must not be negative"
    if opts.join_settle_steps < 0:
        return "engine.join_settle_steps must not be negative"
    if opts.decode_step == "compiled" and opts.batcher == "mlx_lm":
        return (
            "engine.decode_step = 'compiled' runs in the rows batch; BatchGenerator "
            "(batcher = 'mlx_lm') steps with mlx-lm's forward pass"
        )
    compiled = opts.batcher != "mlx_lm" and opts.decode_step != "model"
    for name, default in (("decode_attention", "auto"), ("decode_projections", "separate")):
        if getattr(opts, name) != default and not compiled:
            return f"engine.{name} applies to the compiled step only"
    if opts.first_token == "prefill" and opts.batcher == "mlx_lm":
        return (
            "engine.first_token = 'prefill' applies to the rows batch only, "
            "not to batcher = 'mlx_lm'"
        )
    no_prefill_first = opts.batcher == "mlx_lm" or opts.first_token == "step"
    for name, default in (("prefill_attention", "auto"), ("first_token_read", "pipelined")):
        if getattr(opts, name) != default and no_prefill_first:
            return (
                f"engine.{name} applies to the rows batch with first tokens from the "
                "prefill only, not to batcher = 'mlx_lm' or first_token = 'step'"
            )
    if opts.prefill_shapes == "buckets" and opts.batcher == "mlx_lm":
        return "engine.prefill_shapes applies to the rows batch only, not to batcher = 'mlx_lm'"
    if opts.join_settle_steps and opts.batcher == "mlx_lm":
        return "engine.join_settle_steps applies to the rows batch only, not to batcher = 'mlx_lm'"
    gb = opts.prefix_cache_gb
    if gb is not None and (gb < 0 or not math.isfinite(gb)):
        return "engine.prefix_cache_gb must be a finite number >= 0"
    for key in ("kv_memory_gb", "buffer_cache_gb"):
        value = getattr(opts, key)
        if value is not None and not 0 < value < float("inf"):
            return f"engine.{key} must be positive"
    return None
