"""A decode step that skips the vocabulary log-softmax when nobody reads it.

mlx-lm's GenerationBatch normalizes every row's logits into log probabilities on every
decode step (`logits - logsumexp(logits)`), one exp per vocabulary entry per row, and then
hands the normalized rows to the samplers and to each Response. The engine reads them only
for requests that asked for logprobs, and the samplers it builds give the same tokens on
raw logits: argmax, Gumbel-max categorical, top-k and min-p are all unchanged by a per-row
constant shift. Only top-p exponentiates its input, so it needs the normalized rows to stay
clear of float overflow.

On CPU builds of MLX that exp is the single most expensive elementwise op of a small
model's step (about 28 ns an element on the 2-core Linux test machine, against 0.5 ns for
a multiply), so the normalization costs about a sixth of a 64-row decode step there. On
Apple GPUs it is cheaper but still a full pass over batch x vocabulary.

`LeanGenerationBatch` keeps the upstream step and adds a flag: with `normalize` False its
step is the same forward, logits processors, sampling and pipelined evaluation, on the raw
processed logits, and the per-row logits it hands on stay unevaluated (no one reads them;
the upstream step evaluates one slice per row on every step). The engine sets the flag
before every step from the requests in the batch. Rows that join the batch take their
first token from their own, upstream-stepped batch, so they are normalized whatever the
flag says.

This leans on GenerationBatch's internal state (mlx-lm 0.32, pinned below 0.33):
`attach` checks that state is there and leaves the generator on the upstream step if not,
and tests/test_lean_batch.py compares the two steps token for token.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch

log = logging.getLogger(__name__)

# The GenerationBatch state the lean step reads and writes.
_STATE = (
    "model",
    "uids",
    "prompt_cache",
    "tokens",
    "samplers",
    "fallback_sampler",
    "logits_processors",
    "_current_tokens",
    "_current_logprobs",
    "_next_tokens",
    "_next_logprobs",
    "_token_context",
)


class LeanGenerationBatch(GenerationBatch):
    """GenerationBatch whose step can leave the logits unnormalized (see the module doc)."""

    normalize = True

    def _step(self) -> tuple[list[int], list[mx.array]]:
        if self.normalize:
            return super()._step()
        return self._lean_step()

    def _lean_step(self) -> tuple[list[int], list[mx.array]]:
        b: Any = self  # mlx-lm declares some of this state narrower than it holds
        # Same state transitions as the upstream step: the tokens sampled on the previous
        # call are returned now, while this call's forward pass computes in the background.
        previous, previous_rows = b._next_tokens, b._next_logprobs
        b._current_tokens, b._current_logprobs = previous, previous_rows
        logits = b.model(previous[:, None], cache=b.prompt_cache)[:, -1, :]
        contexts = []
        if any(b.logits_processors):
            rows = []
            for i, processors in enumerate(b.logits_processors):
                row = logits[i : i + 1]
                if processors:
                    context = b._token_context[i].update_and_fetch(previous[i : i + 1])
                    contexts.append(context)
                    for processor in processors:
                        row = processor(context, row)
                rows.append(row)
            logits = mx.concatenate(rows, axis=0)
        samplers = [b.fallback_sampler if s is None else s for s in b.samplers or ()]
        if not samplers or all(s is samplers[0] for s in samplers):
            sampled = (samplers[0] if samplers else b.fallback_sampler)(logits)
        else:
            sampled = mx.concatenate([s(logits[i : i + 1]) for i, s in enumerate(samplers)], axis=0)
        b._next_tokens = sampled
        # Unnormalized rows, read by no one in this mode, are left lazy: only the tokens are
        # evaluated. One evaluated slice per row made the 16-row step 4-7 % slower on the
        # CPU test machine (docs/benchmarks.md). A row that is read after all (the first
        # upstream step after a lean one evaluates its current rows) is computed then.
        b._next_logprobs = list(logits)
        mx.async_eval(b._next_tokens, contexts)
        mx.eval(previous)
        tokens: list[int] = previous.tolist()
        for history, token in zip(b.tokens, tokens, strict=False):
            history.append(token)
        return tokens, previous_rows


def attach(generator: BatchGenerator) -> LeanGenerationBatch | None:
    """Give `generator` the lean step. Its running batch is the one GenerationBatch made in
    its constructor (batches of new rows merge into it), so the class is swapped on that
    instance only. None, and the upstream step kept, when mlx-lm's internals differ."""
    batch: Any = getattr(generator, "_generation_batch", None)
    if type(batch) is not GenerationBatch or not all(hasattr(batch, a) for a in _STATE):
        log.warning("mlx-lm's GenerationBatch has changed: decoding keeps its own step")
        return None
    batch.__class__ = LeanGenerationBatch
    return cast(LeanGenerationBatch, batch)
