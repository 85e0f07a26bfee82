"""Rows being prefilled together in the rows batch (rows.py), and each row's first token
taken from its own prefill.

mlx-lm (`generate_step`, BatchGenerator) prefills a prompt but for its last token and feeds
that token to a decode step of its own: a row's first token costs its prefill and then a
step. Where `FirstToken` knows the model's forward pass (the architectures of
decode_step.py: their layers, final norm and output head), the group prefills the whole
prompt instead and computes the last layer's output and the head at each row's last
position only (`FirstToken`): the first token comes with the prefill, a step of the batch
sooner, and the row joins the batch with its first token as its input, as any running row.
Elsewhere the prompt's last token is the row's first input, as in mlx-lm.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import BatchKVCache, KVCache, TokenBuffer

from worker.backends import prefill_attention
from worker.backends.decode_step import DecodeStep, unsupported
from worker.backends.prefill_buckets import TOKEN_BUCKET, padded_width, views
from worker.backends.prefill_layers import PrefillLayers, takes
from worker.backends.sampling import LogitsProcessor, Sampler
from worker.device import on_cpu, on_cuda
from worker.structured.guide import Guide

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Row:
    uid: int
    sampler: Sampler
    processors: list[LogitsProcessor]
    held: list[int]  # the tokens whose KV the row's cache holds
    last: int  # the prompt's last token
    history: TokenBuffer | None = None  # the processors' view: every token so far
    dead: bool = False
    pending: int = -1  # a token read ahead of its step (rows.py's `_flush`), not yet in `held`
    guide: Guide | None = None  # masks its next tokens (a grammar, a thinking budget)
    # added to the row's positions (mRoPE models: an image's tokens take fewer positions than
    # tokens; the model takes `shifts`, one per row, when any row has one)
    shift: int = 0


@dataclass(slots=True, eq=False)
class Waiting:
    row: Row
    rest: list[int]  # the prompt tokens to prefill (all but the last, unless FirstToken)
    cache: list[Any]  # one KVCache per layer, holding the row's prefix
    since: int  # the batch's step count when it arrived


@dataclass(slots=True, eq=False)
class Group:
    """Rows being prefilled together: one chunk of their prompts per step."""

    rows: list[Row]
    caches: list[Any]  # one BatchKVCache per layer
    tokens: mx.array | None  # (rows, positions) still to prefill, right-padded
    padded: bool  # right padding to move left once the prompts are in
    view: list[Any] | None = None  # what its prefill passes the model (prefill_buckets.py)
    extra: int = 0  # positions padded at the end of every row, dropped once the prompts are in
    ends: list[int] = field(default_factory=list)  # each row's prompt positions to prefill
    done: int = 0  # positions prefilled so far
    # FirstToken: each row's last prompt position's hidden state (rows, hidden), once run
    last: mx.array | None = None


class FirstToken:
    """Each row's first-token logits from the group's own prefill: the model's layers over
    the last chunk as its inner transformer runs them, but the last layer's output (and the
    output head) only from the rows' earliest last prompt position on. mlx-lm's prefill
    never computes that output at all (only the last layer's keys and values reach the
    cache), and computing it over the whole chunk costs a layer's arithmetic over every
    position: the last layer runs in two calls, the positions before the earliest row's end
    (their keys and values only) and the rest (one position where the rows end together, as
    one row's does). A prefill at bucketed shapes (prefill_buckets.py) splits at the token
    bucket's multiple at or before that end instead, so that both calls keep bucketed
    shapes: under CUDA a shape met for the first time costs far more than a known one
    (cuDNN's attention builds a graph for each)."""

    def __init__(self, model: Any, prefill: PrefillLayers | None = None) -> None:
        inner = model.model
        self.embed = inner.embed_tokens
        self.layers = inner.layers
        self.norm = inner.norm
        self.head: Callable[[mx.array], mx.array] = (
            model.lm_head if hasattr(model, "lm_head") else inner.embed_tokens.as_linear
        )
        self.prefill = prefill  # the layers with a kernel's attention (prefill_layers.py)

    def layer(self, i: int, h: mx.array, cache: list[Any]) -> mx.array:
        """Layer i over h with the kernel's attention (callers check there is one)."""
        assert self.prefill is not None
        return self.prefill.run(i, self.layers[i], h, cache[i])

    def forward(self, model: Any, tokens: mx.array, cache: list[Any]) -> None:
        """A chunk before the last: its keys and values written to `cache` (nothing else of
        it is ever evaluated)."""
        if self.prefill is None or not takes(cache):
            model(tokens, cache=cache)
            return
        h = self.embed(tokens)
        for i in range(len(self.layers)):
            h = self.layer(i, h, cache)

    def hidden(self, tokens: mx.array, cache: list[Any], at: list[int], align: int = 1) -> mx.array:
        """(rows, hidden): the final norm's output at position at[i] of row i of the chunk,
        every layer's keys and values for the whole chunk written to `cache`. The last layer
        splits at a multiple of `align` (a prefill at bucketed shapes keeps them: the
        chunk's width is a multiple of the token bucket where `prefill_step_size` is, as
        its default is, and so are both parts)."""
        h = self.embed(tokens)
        if self.prefill is not None and takes(cache):
            for i in range(len(self.layers) - 1):
                h = self.layer(i, h, cache)
            start = min(at) // align * align
            if start > 0:
                self.layer(-1, h[:, :start], cache)  # its output is never computed
                h = h[:, start:]
            out = self.layer(-1, h, cache)
            return self.norm(out[mx.arange(len(at)), mx.array([a - start for a in at])])
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers[:-1], cache[:-1], strict=True):
            h = layer(h, mask, c)
        last, c = self.layers[-1], cache[-1]
        start = min(at) // align * align
        if start > 0:
            before = h[:, :start]
            last(before, create_attention_mask(before, c), c)  # its output is never computed
            h = h[:, start:]
            mask = create_attention_mask(h, c)
        out = last(h, mask, c)
        return self.norm(out[mx.arange(len(at)), mx.array([a - start for a in at])])

    def logits(self, group: Group) -> mx.array:
        """(rows, vocabulary): the head over the rows' last prompt positions."""
        assert group.last is not None
        return self.head(group.last)


def wanted(setting: str) -> bool:
    """Whether `engine.first_token` takes first tokens from the prefill here: "auto" does
    where it was measured sooner (MLX's CUDA backend and its CPU, docs/benchmarks.md), not
    on Metal, where it has not been measured yet."""
    if setting == "auto":
        return on_cpu() or on_cuda()
    return setting == "prefill"


def first_token(
    model: Any, attention: str = "mlx", step: DecodeStep | None = None
) -> FirstToken | None:
    """FirstToken for a model whose layers, final norm and head decode_step.py knows, and
    whose forward pass they match on a probe; else None: the batch keeps mlx-lm's way. Its
    prefill's attention is prefill_attention.py's kernel where `attention`
    (`engine.prefill_attention`) asks for it and `prefill_kernel` makes it; with the
    compiled decode `step`, its layers run the step's compiled functions around it."""
    reason = unsupported(model)
    if reason is not None:
        log.info("first tokens: a decode step after the prefill (%s)", reason)
        return None
    first = FirstToken(model)
    mismatch = probe(model, first)
    if mismatch is not None:
        log.warning(
            "first tokens: a decode step after the prefill (this mlx-lm's model computes "
            "other logits than its layers and head do on a probe: %s)",
            mismatch,
        )
        return None
    if attention == "kernel" or (attention == "auto" and on_cuda()):
        first.prefill = prefill_kernel(model, asked=attention == "kernel", step=step)
    return first


def prefill_kernel(model: Any, asked: bool, step: DecodeStep | None = None) -> PrefillLayers | None:
    """The prefill's layers with the kernel's attention, where it is `asked` for or the
    model's heads are of a size it was measured faster at (prefill_attention.AUTO_HEAD_DIMS),
    the kernel is made for the model's layout and dtype (its own check) and the layers
    compute the model's first tokens with MLX's attention in the kernel's place (the probe:
    the layers are the project's: the compiled decode `step`'s functions, else the model's
    modules, in mlx-lm's order); else None, logged. Layers on the step that fail the probe
    (e.g. a step of stacked projections, whose rounding drifts over a model's layers in
    bfloat16) give way to the modules' before the kernel is given up."""
    attn = model.model.layers[0].self_attn
    dim = attn.q_proj.weight.shape[0] // attn.n_heads  # output rows, packed or not
    dtype = model.model.norm.weight.dtype  # the model's activations'
    head_norms = hasattr(attn, "q_norm")
    level = logging.WARNING if asked else logging.INFO
    if not asked and dim not in prefill_attention.AUTO_HEAD_DIMS:
        log.info(
            "prefill attention: MLX's (heads of %d: the kernel was measured faster at %s; "
            "engine.prefill_attention = 'kernel' takes it)",
            dim,
            " and ".join(map(str, prefill_attention.AUTO_HEAD_DIMS)),
        )
        return None
    kernel = prefill_attention.make(attn.n_heads, attn.n_kv_heads, dim, attn.scale, dtype)
    if kernel is None:
        if asked:
            log.warning("engine.prefill_attention = 'kernel': MLX's attention (logged above)")
        return None

    def mlx(q: mx.array, k: mx.array, v: mx.array, base: mx.array, starts: mx.array) -> Any:
        return prefill_attention.reference(q, k, v, base, starts, attn.scale)

    mismatch = probe(model, FirstToken(model, PrefillLayers(mlx, head_norms, step)))
    if mismatch is not None and step is not None:
        log.info("prefill attention: its layers around the compiled step differ (%s)", mismatch)
        step = None
        mismatch = probe(model, FirstToken(model, PrefillLayers(mlx, head_norms)))
    if mismatch is not None:
        log.log(level, "prefill attention: MLX's (the layers compute other logits: %s)", mismatch)
        return None
    around = "the compiled step's layers" if step is not None else "the model's modules"
    log.info("prefill attention: the project's kernel (heads of %d, %s; %s)", dim, dtype, around)
    return PrefillLayers(kernel, head_norms, step)


ROUNDING = 0.02  # the most a backend's rounding may be, as a share of the largest logit


def probe(model: Any, first: FirstToken) -> str | None:
    """None when the first tokens' logits match the model's forward pass over each prompt
    alone: one row (the last layer's output at its last position only), and two rows of
    different lengths prefilled side by side (right-padded: its output from the shorter
    row's end on); else where and how far they differ. They match when they are as close
    as decode_step.py's probe asks (its tolerance), or within twice as far from the model's
    as mlx-lm's own first token is (its prompt but the last token prefilled, then that token
    decoded), that distance taken as at most ROUNDING of the largest logit: on a GPU,
    bfloat16 rounds a product over a few positions otherwise than over one, and attention
    over a whole prompt runs another kernel than a decode step's, so the backend's rounding
    sets the yardstick (0.03-0.05 at logits of about 5 on an H100, docs/benchmarks.md),
    while a forward pass the layers and head do not make at all (a scaled output, another
    head) is off by far more, and an mlx-lm whose own first token is far off vouches for
    nothing."""
    layers = len(model.model.layers)
    for prompts in ([[1, 2, 3, 4]], [[1, 2, 3, 4, 5], [6, 7, 8]]):
        waiting = [
            Waiting(Row(i, lambda x: x, [], [], p[-1]), p, [KVCache() for _ in range(layers)], 0)
            for i, p in enumerate(prompts)
        ]
        group, _ = start_group(waiting, 64, len(prompts), False)
        prefill_chunk(model, group, 64, first)
        got = first.logits(group).astype(mx.float32)
        for i, p in enumerate(prompts):
            want = model(mx.array([p]))[0, -1].astype(mx.float32)
            if mx.allclose(got[i], want, rtol=2e-2, atol=2e-2).item():
                continue
            off = mx.max(mx.abs(got[i] - want))
            rounding = mx.max(mx.abs(mlx_lm_first(model, p, layers) - want))
            bound = mx.minimum(rounding, ROUNDING * mx.max(mx.abs(want)))
            if (off <= 2 * bound).item():
                continue
            return (
                f"row {i + 1} of {len(prompts)}: logits off by up to {off.item():.4g}, mlx-lm's "
                f"own first token's by {rounding.item():.4g} (largest logit "
                f"{mx.max(mx.abs(want)).item():.4g}, {mx.sum(mx.isnan(got[i])).item()} NaN)"
            )
    return None


def mlx_lm_first(model: Any, prompt: list[int], layers: int) -> mx.array:
    """The first token's logits as mlx-lm's generation computes them: the prompt but its last
    token prefilled into a cache, then the last token decoded over it."""
    cache = [KVCache() for _ in range(layers)]
    model(mx.array([prompt[:-1]]), cache=cache)
    return model(mx.array([prompt[-1:]]), cache=cache)[0, -1].astype(mx.float32)


def start_group(
    waiting: list[Waiting], chunk: int, max_group: int, buckets: bool
) -> tuple[Group, list[Waiting]]:
    """The oldest waiting row and those behind it whose prompts take as many chunks (a
    group is padded to its longest prompt, and a short prompt grouped with a long one would
    be computed at the long one's length and wait for all of it); and the rows left waiting."""

    def chunks(tokens: list[int]) -> int:
        return max(1, -(-len(tokens) // chunk))

    need = chunks(waiting[0].rest)
    taken: list[Waiting] = []
    later: list[Waiting] = []
    for item in waiting:
        fits = len(taken) < max_group and chunks(item.rest) == need
        (taken if fits else later).append(item)
    rows = [w.row for w in taken]
    rests = [w.rest for w in taken]
    layers = len(taken[0].cache)
    caches = [BatchKVCache.merge([w.cache[layer] for w in taken]) for layer in range(layers)]
    longest = max(len(r) for r in rests)
    if longest == 0:
        return Group(rows, caches, None, False), later
    padding = [longest - len(r) for r in rests]
    padded = max(padding) > 0
    if padded:
        for c in caches:
            c.prepare(lengths=[len(r) for r in rests], right_padding=padding)
    view = views(caches) if buckets else None
    extra = padded_width(longest, chunk) - longest if view else 0
    tokens = mx.array([r + [0] * (p + extra) for r, p in zip(rests, padding, strict=True)])
    ends = [len(r) for r in rests]
    return Group(rows, caches, tokens, padded, view, extra, ends), later


def prefill_chunk(model: Any, group: Group, chunk: int, first: FirstToken | None) -> int:
    """Runs the group's next chunk (with `first`, keeping the hidden states of the rows
    whose last prompt position it holds); the positions run, padding included."""
    if group.tokens is None:
        return 0
    n = min(chunk, group.tokens.shape[1])
    tokens, cache = group.tokens[:, :n], group.view or group.caches
    rest = group.tokens[:, n:]
    if first is None:
        model(tokens, cache=cache)
    elif rest.shape[1] > 0:
        first.forward(model, tokens, cache)
    else:
        # the rows' prompts take as many chunks each (start_group) and the end's padding
        # stays inside the last one: every row's last position is in this chunk
        at = [e - 1 - group.done for e in group.ends]
        group.last = first.hidden(tokens, cache, at, TOKEN_BUCKET if group.view else 1)
    group.done += n
    group.tokens = rest if rest.shape[1] > 0 else None
    for c in group.caches if group.tokens is None else ():
        if group.extra:
            c.trim(group.extra)  # the end's padding (prefill_buckets.py)
        if group.padded:
            c.finalize()
    mx.async_eval([c.state for c in group.caches], [] if group.last is None else group.last)
    return n * tokens.shape[0]
