"""SamplingParams -> mlx-lm samplers and logits processors (public mlx_lm.sample_utils API)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
)

from shared.types import SamplingParams
from worker.structured.guide import Guide, Masks

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

# Penalties look back this many tokens (prompt and output), as mlx-lm's processors do.
PENALTY_CONTEXT = 256


def greedy(logprobs: mx.array) -> mx.array:
    """The most likely token (one function object: greedy rows are sampled in one call)."""
    return mx.argmax(logprobs, axis=-1)


def make_sampler(params: SamplingParams, vocab_size: int, drawn: int = 0) -> Sampler:
    """Greedy requests share one sampler object, so mlx-lm samples them in one batched call.
    A seeded sampler's key is split once a token; `drawn`: tokens a continuation's earlier
    worker drew with it (its key goes on from there)."""
    if params.temperature == 0:
        return greedy
    filters: list[Callable[[mx.array], mx.array]] = []
    if 0 < params.top_p < 1:
        top_p = params.top_p
        filters.append(lambda x: apply_top_p(x, top_p))
    if params.min_p > 0:
        min_p = params.min_p
        filters.append(lambda x: apply_min_p(x, min_p))
    if 0 < params.top_k < vocab_size:
        top_k = params.top_k
        filters.append(lambda x: apply_top_k(x, top_k))
    scale = 1.0 / params.temperature
    # Any integer is a valid seed (OpenAI allows negatives); MLX keys take an unsigned 64-bit.
    key = None
    if params.seed is not None:
        first = mx.random.key(params.seed % 2**64)
        for _ in range(drawn):
            first = mx.random.split(first)[0]
        key = [first]

    def sample(logprobs: mx.array) -> mx.array:
        for keep in filters:
            logprobs = keep(logprobs)
        if key is None:
            return mx.random.categorical(logprobs * scale)
        key[0], step_key = mx.random.split(key[0])
        return mx.random.categorical(logprobs * scale, key=step_key)

    return sample


def make_processors(params: SamplingParams, eos_ids: Iterable[int]) -> list[LogitsProcessor]:
    processors: list[LogitsProcessor] = make_logits_processors(
        logit_bias=dict(params.logit_bias) or None,
        repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1 else None,
        repetition_context_size=PENALTY_CONTEXT,
        presence_penalty=params.presence_penalty or None,
        presence_context_size=PENALTY_CONTEXT,
        frequency_penalty=params.frequency_penalty or None,
        frequency_context_size=PENALTY_CONTEXT,
    )
    banned = sorted(set(eos_ids) | set(params.stop_token_ids))
    if params.min_tokens > 0 and banned:
        processors.append(_min_tokens_processor(params.min_tokens, banned))
    return processors


def guide_processors(guide: Guide | None, masks: Masks | None = None) -> list[LogitsProcessor]:
    """A guide as a logits processor for BatchGenerator: each call after the first (the
    prompt's) hands it the row's last token, then masks. Reading that token waits for the
    step that made it, so a guided row costs the generator its overlap of host and device
    (the rows batch keeps it: worker/backends/rows.py)."""
    if guide is None:
        return []
    masks = masks or Masks()
    first = [True]

    def processor(tokens: mx.array, logits: mx.array) -> mx.array:
        if first[0]:
            first[0] = False
        else:
            guide.consume(cast(int, tokens[-1].item()))
            guide.settle()
        bitmask = guide.bitmask(1)
        return masks.apply(logits, bitmask) if guide.fill(bitmask, 0) else logits

    return [processor]


def _min_tokens_processor(min_tokens: int, banned: list[int]) -> LogitsProcessor:
    """Forbid stop tokens until `min_tokens` tokens were sampled (as vLLM's min_tokens)."""
    indices = mx.array(banned)
    sampled = [0]

    def processor(_tokens: mx.array, logits: mx.array) -> mx.array:
        sampled[0] += 1
        if sampled[0] > min_tokens:
            return logits
        return logits.at[:, indices].add(-float("inf"))

    return processor


def process_rows(rows: Sequence[Any], inputs: mx.array, logits: mx.array) -> mx.array:
    """A batch's logits through each row's logits processors (`row.processors`), given every
    token the row has seen (`row.history`, a TokenBuffer), this step's input included (still
    on the device for a running row)."""
    lines = []
    for i, row in enumerate(rows):
        line = logits[i : i + 1]
        if row.history is not None:
            history = row.history.update_and_fetch(inputs[i : i + 1])
            for processor in row.processors:
                line = processor(history, line)
        lines.append(line)
    return mx.concatenate(lines, axis=0)


def sample_rows(
    rows: Sequence[Any], inputs: mx.array, logits: mx.array
) -> tuple[mx.array, mx.array]:
    """Each row's next token and the distribution it was drawn from (log-probabilities),
    given its logits and this step's input tokens (the processors' history): rows sharing
    one sampler object (greedy ones) in one call."""
    if any(r.processors for r in rows):
        logits = process_rows(rows, inputs, logits)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    samplers = [r.sampler for r in rows]
    if all(s is samplers[0] for s in samplers):
        return samplers[0](logprobs), logprobs
    sampled = mx.concatenate([s(logprobs[i : i + 1]) for i, s in enumerate(samplers)], axis=0)
    return sampled, logprobs
