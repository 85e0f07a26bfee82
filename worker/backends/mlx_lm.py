"""The engine's backend on mlx-lm: loading, continuous batching through BatchGenerator's
public API (insert with caches, next, remove with caches), prompt scoring, and the KV cache
operations the prefix cache needs.

Only the parts of mlx-lm's API that 0.32 and its main branch share are used: stop tokens and
stop sequences are decided by the engine (tokens come back to it every step anyway), so the
generator is built without any; a finished row's cache comes from `remove(...,
return_prompt_caches=True)` or from the response that ends it at max_tokens.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import mlx.core as mx
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer
from mlx_lm.utils import sharded_load

from shared.config import EngineOptions
from worker.backends import decode_step, groups, prefill_buckets, shelves
from worker.backends.rows import RowBatch
from worker.backends.sampling import guide_processors, make_processors, make_sampler
from worker.backends.shelves import Shelved
from worker.device import on_cuda
from worker.engine.backend import Insertion, Sampled
from worker.memory import prefix_cache_bound
from worker.structured.guide import Masks

log = logging.getLogger(__name__)


def load(path: str, trust_remote_code: bool = False) -> tuple[Any, Any]:
    model, tokenizer = mlx_lm_load(path, trust_remote_code=trust_remote_code)[:2]
    return model, tokenizer


def load_sharded(
    path: str, group: mx.distributed.Group, trust_remote_code: bool = False, pipeline: bool = False
) -> tuple[Any, Any]:
    """This rank's shard of the model, tensor parallel (or with `pipeline`, its run of
    layers) over `group` (mlx-lm's sharded_load); every rank of the group calls it together."""
    loaded = sharded_load(
        path,
        pipeline_group=group if pipeline else None,
        tensor_group=None if pipeline else group,
        trust_remote_code=trust_remote_code,
    )
    return loaded[0], loaded[1]


def parameter_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Names and shapes of mlx-lm's Llama (or Qwen2) parameters for a config (its arrays
    stay lazy)."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama, qwen2

    module = qwen2 if config.get("model_type") == "qwen2" else llama
    model = module.Model(module.ModelArgs.from_dict(config))
    params: dict[str, Any] = dict(tree_flatten(model.parameters()))
    return {name: tuple(p.shape) for name, p in params.items()}


class MlxLmBackend:
    batcher = "mlx_lm"  # the continuous batch it runs (engine.batcher)

    def __init__(self, model: Any, tokenizer: Any, options: EngineOptions) -> None:
        self._setup(model, tokenizer, options)
        self.generator = BatchGenerator(
            model,
            completion_batch_size=options.max_running,
            prefill_batch_size=self.prefill_batch_size,
            prefill_step_size=options.prefill_step_size,
        )
        self.uids: set[int] = set()  # in the generator
        self.masks = Masks()  # guided rows' mask tables

    def _setup(self, model: Any, tokenizer: Any, options: EngineOptions) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(tokenizer.eos_token_ids)
        self.vocab_size = len(tokenizer)
        self.prefill_batch_size = max(1, min(options.prefill_batch_size, options.max_running))
        self.prefill_step_size = options.prefill_step_size

    @property
    def detokenizer_kind(self) -> str:
        detokenizer = self.tokenizer.detokenizer
        if isinstance(detokenizer, BPEStreamingDetokenizer):
            return "bpe"
        if isinstance(detokenizer, SPMStreamingDetokenizer):
            return "spm"
        return "text"

    @property
    def device(self) -> str:
        return "cpu" if mx.default_device() == mx.cpu else "gpu"

    # ---- the batch ----------------------------------------------------------------------

    def insert(self, items: list[Insertion]) -> list[int]:
        if any(i.shift for i in items):
            raise ValueError("BatchGenerator cannot shift a row's positions (batcher = 'rows')")
        uids: list[int] = self.generator.insert(
            [i.prompt for i in items],
            max_tokens=[i.max_tokens for i in items],
            caches=[i.cache if i.cache is not None else self.new_cache() for i in items],
            all_tokens=[list(i.prefix) for i in items],
            samplers=[make_sampler(i.sampling, self.vocab_size, i.drawn) for i in items],
            logits_processors=[
                make_processors(i.sampling, i.stop_ids) + guide_processors(i.guide, self.masks)
                for i in items
            ],
        )
        self.uids.update(uids)
        return uids

    def step(self, keep_caches: bool, logprobs: bool = True) -> list[Sampled]:
        """One generator step: decode the running rows, prefill a chunk of the new ones.
        A row that reached its max_tokens has left the generator. (BatchGenerator gives
        every row's distribution whether asked or not.)"""
        _, responses = self.generator.next()
        sampled = []
        for r in responses:
            ended = r.finish_reason is not None
            if ended:
                self.uids.discard(r.uid)
            keep = ended and keep_caches
            sampled.append(
                Sampled(
                    r.uid,
                    r.token,
                    r.logprobs,
                    ended,
                    r.prompt_cache if keep else None,
                    r.all_tokens if keep else None,
                )
            )
        return sampled

    def remove(
        self, uids: list[int], keep_caches: bool = False
    ) -> dict[int, tuple[Any, list[int]]]:
        """Take rows out of the batch (their KV goes with them); with `keep_caches`, each
        row's cache and the tokens it holds."""
        present = [u for u in uids if u in self.uids]
        if not present:
            return {}
        self.uids.difference_update(present)
        caches = self.generator.remove(present, return_prompt_caches=keep_caches)
        return dict(caches) if keep_caches else {}

    def extract(self, uids: list[int]) -> dict[int, tuple[Any, list[int]]]:
        """A copy of rows' caches, and the tokens each holds; the rows stay in the batch."""
        present = [u for u in uids if u in self.uids]
        return dict(self.generator.extract_cache(present)) if present else {}

    @property
    def active(self) -> bool:
        return bool(self.uids)

    def holds(self, uid: int) -> bool:
        return uid in self.uids

    # ---- KV caches ----------------------------------------------------------------------

    def new_cache(self) -> list[Any]:
        return make_prompt_cache(self.model)

    # A cache taken out of the rows batch is a row on a shelf (worker/backends/shelves.py);
    # BatchGenerator's are lists of mlx-lm caches.

    def nbytes(self, cache: Any) -> int:
        return cache.nbytes if isinstance(cache, Shelved) else sum(c.nbytes for c in cache)

    def trimmable(self, cache: Any) -> bool:
        return isinstance(cache, Shelved) or can_trim_prompt_cache(cache)

    def prefix(self, cache: Any, length: int, tokens: int) -> list[Any]:
        if isinstance(cache, Shelved):
            return cache.caches(length)
        # MLX arrays are values: the copy shares their buffers, and trimming only moves the
        # copy's offsets. The generator merges caches into new batch arrays on insert, so
        # the stored cache is never written.
        copied = copy.deepcopy(cache)
        if tokens > length:
            trim_prompt_cache(copied, tokens - length)
        return copied

    def storage(self, cache: Any) -> tuple[Any, int] | None:
        return shelves.storage(cache)

    def own(self, cache: Any) -> Any:
        return cache.copy() if isinstance(cache, Shelved) else cache

    def compact(self, caches: list[Any]) -> None:
        """Have caches taken out of the batch evaluated, so that they hold buffers of their
        own (a shelf's, shared by the rows on it) and not the graph of the batch's (which
        would keep the batch's arrays alive). Queued in one call, not waited for: waiting
        would stall the step running on the device."""
        arrays: list[Any] = []
        seen: set[int] = set()
        for cache in caches:
            if not isinstance(cache, Shelved):
                arrays += [c.state for c in cache]
            elif id(cache.shelf) not in seen:
                seen.add(id(cache.shelf))
                arrays += [cache.shelf.keys, cache.shelf.values]
        mx.async_eval(arrays)

    def kv_bytes_per_token(self) -> int:
        """The KV one position takes, measured on a one-token forward pass."""
        cache = self.new_cache()
        self.model(mx.array([[0]]), cache=cache)
        mx.eval([c.state for c in cache])
        sizes = [c.size() for c in cache if hasattr(c, "size")]
        positions = max([s for s in sizes if s] or [1])
        # KVCache allocates a step of positions at once: per position, what it allocated
        allocated = max(
            (
                c.keys.shape[2]
                for c in cache
                if getattr(c, "keys", None) is not None and hasattr(c.keys, "shape")
            ),
            default=positions,
        )
        return max(1, self.nbytes(cache) // max(positions, allocated))

    # ---- prompt scoring (echo + logprobs) ------------------------------------------------

    def forward_logprobs(self, tokens: list[int], cache: list[Any]) -> mx.array:
        """(len(tokens), vocab) float32 log probabilities after each token, `cache` extended."""
        logits = self.model(mx.array(tokens)[None], cache=cache)[0].astype(mx.float32)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def release_memory(self) -> None:
        """Idle: hand MLX's cached buffers back to the system."""
        mx.clear_cache()

    def close(self) -> None:
        self.generator.close()


class MlxRowsBackend(MlxLmBackend):
    """The same model and KV cache operations, with the project's own continuous batch
    (`worker/backends/rows.py`) in place of BatchGenerator."""

    batcher = "rows"

    def __init__(self, model: Any, tokenizer: Any, options: EngineOptions) -> None:
        kinds = cache_kinds(model)
        if kinds != {"KVCache"}:
            raise ValueError(
                "engine.batcher = 'rows' needs a model whose layers all keep a plain KV cache; "
                f"this one uses {', '.join(sorted(kinds))}: use batcher = 'mlx_lm'"
            )
        self._setup(model, tokenizer, options)
        compiled = decode_step.wanted(options.decode_step)
        if not compiled and options.decode_step == "auto":  # Metal: named settings say so
            named = []
            if options.decode_projections != "separate":
                named.append(f"decode_projections = {options.decode_projections!r}")
            if options.decode_attention == "kernel":
                named.append(f"decode_attention = {options.decode_attention!r}")
            if named:
                log.warning(
                    "engine.%s: no effect here: engine.decode_step = 'auto' keeps mlx-lm's "
                    "forward pass on this backend (set decode_step = 'compiled')",
                    ", ".join(named),
                )
        if options.prefill_attention == "kernel" and not groups.wanted(options.first_token):
            log.warning(
                "engine.prefill_attention = 'kernel': no effect here: first tokens come from "
                "a decode step after the prefill (engine.first_token = 'auto' keeps mlx-lm's "
                "way on this backend; set first_token = 'prefill')"
            )
        decode = (
            decode_step.build(
                model,
                fuse=options.decode_projections == "stacked",
                asked=options.decode_step == "compiled",
                ragged=options.decode_attention != "mlx",
                ragged_asked=options.decode_attention == "kernel",
            )
            if compiled
            else None
        )
        self.batch = RowBatch(
            model,
            options.prefill_step_size,
            self.prefill_batch_size,
            settle_steps=options.join_settle_steps,
            decode=decode,
            # what it saves was measured on MLX's CUDA backend only (buckets.py)
            bucket_rows=on_cuda(),
            # a shelf the prefix cache keeps whole while any of its rows is kept
            shelf_bytes=max(1, prefix_cache_bound(options) // 8),
            prefill_buckets=prefill_buckets.wanted(options.prefill_shapes),
            first=(
                groups.first_token(model, options.prefill_attention, decode)
                if groups.wanted(options.first_token)
                else None
            ),
            early_first=options.first_token_read == "early",
        )
        if self.batch.early_first and self.batch.first is None:
            log.warning(
                "engine.first_token_read = 'early': no effect here: first tokens come from a "
                "decode step after the prefill (engine.first_token = 'auto' keeps mlx-lm's way "
                "on this backend, or this model's first tokens cannot come from its prefill)"
            )

    def insert(self, items: list[Insertion]) -> list[int]:
        return self.batch.insert(
            [i.prompt for i in items],
            [i.cache if i.cache is not None else self.new_cache() for i in items],
            [list(i.prefix) for i in items],
            [make_sampler(i.sampling, self.vocab_size, i.drawn) for i in items],
            [make_processors(i.sampling, i.stop_ids) for i in items],
            [i.guide for i in items],
            [i.shift for i in items],
        )

    def step(self, keep_caches: bool, logprobs: bool = True) -> list[Sampled]:
        """Rows never end here: the engine's max_tokens and stops end them (remove)."""
        return [Sampled(uid, token, row, False) for uid, token, row in self.batch.step(logprobs)]

    def remove(
        self, uids: list[int], keep_caches: bool = False
    ) -> dict[int, tuple[Any, list[int]]]:
        return self.batch.remove(uids, keep_caches)

    def extract(self, uids: list[int]) -> dict[int, tuple[Any, list[int]]]:
        return self.batch.extract(uids)

    @property
    def active(self) -> bool:
        return self.batch.active

    def holds(self, uid: int) -> bool:
        return self.batch.holds(uid)

    def close(self) -> None:
        pass


def cache_kinds(model: Any) -> set[str]:
    """The KV cache classes of the model's layers (by name)."""
    return {type(c).__name__ for c in make_prompt_cache(model)}


def make_backend(model: Any, tokenizer: Any, options: EngineOptions) -> MlxLmBackend:
    """The backend `engine.batcher` names; "auto" takes the rows batch wherever it can hold
    the model's caches (ahead of BatchGenerator in first tokens at every level and in
    throughput at most, docs/benchmarks.md)."""
    batcher = options.batcher
    if batcher == "auto":
        batcher = "rows" if cache_kinds(model) == {"KVCache"} else "mlx_lm"
        for name, asked in (
            ("join_settle_steps", options.join_settle_steps != 0),
            ("prefill_shapes", options.prefill_shapes == "buckets"),
        ):
            if batcher == "mlx_lm" and asked:
                log.warning(
                    "engine.%s has no effect: this model's caches need BatchGenerator "
                    "(batcher = 'mlx_lm')",
                    name,
                )
        if batcher == "mlx_lm" and options.decode_step == "compiled":
            log.warning(
                "engine.decode_step = 'compiled' has no effect: this model's caches need "
                "BatchGenerator (batcher = 'mlx_lm')"
            )
    if batcher == "rows":
        return MlxRowsBackend(model, tokenizer, options)
    if getattr(getattr(model, "model", None), "pipeline_size", 1) > 1:
        # through BatchGenerator, mlx-lm's pipeline gave other tokens on a prefix-cache hit
        raise ValueError(
            "a pipelined model runs on the rows batch, and this one's caches need "
            "BatchGenerator: use sharding = 'tensor'"
        )
    return MlxLmBackend(model, tokenizer, options)
