"""EngineCore: add, abort, step. No sockets: the worker process feeds it and ships what
step() returns.

A step reads as a recipe: score a chunk of an echo prompt (if any), let the scheduler pick
the waiting requests that start now, start them (each with the longest cached prefix of its
prompt), run one backend step (decode the batch, prefill a chunk of the new rows), and turn
the sampled tokens into deltas. Finished rows leave their KV to the prefix cache.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from shared.config import EngineOptions
from shared.protocol import PrefixCacheStats
from shared.types import (
    ErrorCode,
    FinishReason,
    RequestError,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from worker.engine.backend import Backend, Insertion, Sampled
from worker.engine.output import OutputProcessor
from worker.engine.prefix_cache import PrefixCache
from worker.engine.prefix_plan import PrefixPlan
from worker.engine.request import Request, RequestStatus
from worker.engine.scheduler import Scheduler, SchedulerConfig
from worker.engine.stop import StopStringMatcher
from worker.memory import prefix_cache_bound
from worker.preprocess import PreparedRequest

log = logging.getLogger(__name__)

# A request whose prompt had at least this many tokens to prefill leaves a copy of its
# prompt's KV in the prefix cache as soon as it has its first token, not only when it ends:
# other clients with the same long system prompt, arriving while it runs, reuse it.
SNAPSHOT_TOKENS = 256


class EngineCore:
    def __init__(
        self,
        backend: Backend,
        options: EngineOptions,
        kv_budget_bytes: int | None = None,
    ) -> None:
        self.backend = backend
        self.options = options
        self.output = OutputProcessor(backend.tokenizer, backend.detokenizer_kind)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_running=options.max_running,
                max_prefill_requests=backend.prefill_batch_size,
                max_prefill_tokens=options.max_prefill_tokens,
                batch_share=options.batch_share,
                kv_budget_bytes=kv_budget_bytes,
                kv_bytes_per_token=backend.kv_bytes_per_token() if kv_budget_bytes else 0,
            )
        )
        capacity = prefix_cache_bound(options)
        self.prefix_cache = PrefixCache(capacity, backend) if capacity > 0 else None
        cache = self.prefix_cache
        self.plan = PrefixPlan(cache, SNAPSHOT_TOKENS) if cache is not None else None
        self._told_oversize = False  # a KV too large for the prefix cache was logged
        self.requests: dict[str, Request] = {}  # every request the engine holds
        self.by_uid: dict[int, Request] = {}  # those in the backend's batch
        self.scoring: dict[str, Scoring] = {}  # echo + logprobs: prompts being scored
        self.compiling: list[Request] = []  # queued while their grammars compile
        self.logprob_requests = 0  # in the batch and asking for logprobs (0: step skips them)
        self.steps = 0
        # what the last step put off until its outputs went out (settle)
        self.unsettled: Unsettled | None = None

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    @property
    def can_step(self) -> bool:
        """A step would do something now: not only requests that wait on their grammar's
        compile (the worker then waits for its inputs, which that compile's end wakes)."""
        return bool(self.scoring) or self.backend.active or self.scheduler.startable()

    def request_ids(self) -> list[str]:
        return list(self.requests)

    def counts(self) -> tuple[int, int]:
        """(running, waiting): waiting requests have not produced a token yet."""
        running = sum(1 for r in list(self.requests.values()) if r.status is RequestStatus.RUNNING)
        return running, len(self.requests) - running

    def prefix_stats(self) -> PrefixCacheStats | None:
        return self.prefix_cache.stats() if self.prefix_cache is not None else None

    # ---- add / abort ------------------------------------------------------------------

    def add(self, prepared: PreparedRequest) -> RequestOutput | None:
        """Queue a request (an echo request with logprobs has its prompt scored first); an
        echo request with max_tokens 0 that needs no scoring is answered here."""
        params = prepared.sampling
        if prepared.resumed:  # a continuation: the echo went out with its first delta
            params = msgspec.structs.replace(
                params, echo=False, min_tokens=max(0, params.min_tokens - prepared.resumed)
            )
        if not prepared.prompt:
            raise ValueError("the prompt is empty")
        if prepared.request_id in self.requests:
            raise ValueError(f"request {prepared.request_id} is already running")
        stop_ids = set(params.stop_token_ids) | (
            set() if params.ignore_eos else self.backend.eos_ids
        )
        request = Request(
            prepared.request_id,
            prepared.prompt,
            prepared.max_tokens,
            params,
            prepared.priority,
            stop_ids=frozenset(stop_ids),
            stop=StopStringMatcher(params.stop, params.include_stop_str_in_output),
            prompt_text=self.backend.tokenizer.decode(prepared.prompt) if params.echo else None,
            guide=prepared.guide,
            parser=prepared.parser,
            media=prepared.media,
            key=prepared.key,
            resumed=prepared.resumed,
        )
        now = time.perf_counter()
        request.prepared_at = prepared.prepared_at or now
        request.received_at = prepared.received_at or request.prepared_at
        self.output.start(request)
        if request.resumed:
            self._prime(request, prepared.prompt[-request.resumed :])
        if params.echo and params.logprobs:
            request.status = RequestStatus.SCORING
            first = self.output.first_prompt_entry(prepared.prompt[0])
            self.scoring[request.request_id] = Scoring(request, [first], self.backend.new_cache())
            self.requests[request.request_id] = request
            return None
        return self._queue(request)

    def _prime(self, request: Request, tokens: list[int]) -> None:
        """A continuation's earlier tokens, read as if made here (its text, stop strings,
        thinking, tool calls and grammar where they were), nothing sent: what follows comes
        out as it would have."""
        for token in tokens:
            if request.guide is not None:
                request.guide.consume(token)
                request.guide.settle()
            self.output.on_token(request, token)
            if request.status is RequestStatus.FINISHED:
                raise ValueError("the resumed tokens end the request already")
        request.status = RequestStatus.WAITING

    def _queue(self, request: Request) -> RequestOutput | None:
        if request.max_tokens == 0:
            return self.output.finish(request, FinishReason.LENGTH)
        self.requests[request.request_id] = request
        self.scheduler.add(request)
        if request.guide is not None and request.guide.compiling is not None:
            self.compiling.append(request)
        return None

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        """Remove requests wherever they are (their KV goes with them); idempotent."""
        self.settle()
        found = [r for i in request_ids if (r := self.requests.get(i)) is not None]
        if not found:
            return []
        self.scheduler.remove_waiting({r.request_id for r in found})
        # a row that made tokens leaves its KV for reuse (a client retrying); one still in
        # prefill holds a partial prompt, which goes
        running = [r.uid for r in found if r.status is RequestStatus.RUNNING and r.uid is not None]
        prefilling = [
            r.uid for r in found if r.status is RequestStatus.PREFILLING and r.uid is not None
        ]
        if running:
            keep = self.prefix_cache is not None
            self._store(self._keyed(self.backend.remove(running, keep_caches=keep)))
        if prefilling:
            self.backend.remove(prefilling)
        outputs = []
        for request in found:
            self.scoring.pop(request.request_id, None)
            self._forget(request)
            outputs.append(self.output.finish(request, FinishReason.ABORT))
        return outputs

    # ---- step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self.settle()
        self.steps += 1
        outputs = self._score_step() if self.scoring else []
        if self.compiling:
            outputs += self._compiled()
        outputs += self._start(self.scheduler.schedule(self.plan))
        if self.backend.active:
            sampled = self.backend.step(
                keep_caches=self.prefix_cache is not None, logprobs=self.logprob_requests > 0
            )
            outputs += self._process(sampled)
        return outputs

    def _start(self, admitted: list[Request]) -> list[RequestOutput]:
        """Admitted requests into the batch; those whose images the model refuses answered."""
        failed: list[RequestOutput] = []
        items = []
        now = time.perf_counter()
        for request in list(admitted):
            request.admitted_at = now
            hit = (
                self.prefix_cache.lookup(request.prefix_key)
                if self.prefix_cache is not None
                else None
            )
            cached = hit.length if hit is not None else 0
            request.cached_tokens = cached
            cache, shift = hit.cache if hit is not None else None, 0
            if request.media is not None:  # images: prefilled here, the batch decodes
                prefill = self.backend.prefill  # type: ignore[attr-defined]  # a vision backend
                try:
                    cache, shift = prefill(request.prompt, request.media, cache, cached)
                except Exception as exc:  # the model refused this prompt: it alone fails
                    admitted.remove(request)
                    message = f"the model could not take this prompt's images: {exc}"
                    failed.append(self._refused(request, message, "messages"))
                    continue
                request.media = None  # the pixels are in the KV now
                cached = len(request.prompt) - 1
            items.append(
                Insertion(
                    request.prompt[cached:],
                    request.prompt[:cached],
                    cache,
                    request.max_tokens - request.resumed,
                    request.sampling,
                    request.stop_ids,
                    request.guide,
                    shift,
                    request.resumed,
                )
            )
        if not items:
            return failed
        for request, uid in zip(admitted, self.backend.insert(items), strict=True):
            request.uid = uid
            request.status = RequestStatus.PREFILLING
            self.by_uid[uid] = request
            self.logprob_requests += request.wants_logprobs
        return failed

    def _compiled(self) -> list[RequestOutput]:
        """Requests whose grammars have compiled since the last step: those that could not
        be compiled are answered now (a 400), without waiting for a place in the batch."""
        failed: list[RequestOutput] = []
        for request in list(self.compiling):
            guide = request.guide
            assert guide is not None
            if not guide.ready():
                continue
            self.compiling.remove(request)
            if guide.compile_error is None or request.request_id not in self.requests:
                continue  # compiled, or aborted meanwhile
            self.scheduler.remove_waiting({request.request_id})
            message = f"the constraint cannot be compiled: {guide.compile_error}"
            failed.append(self._refused(request, message, guide.param))
        return failed

    def _refused(self, request: Request, message: str, param: str) -> RequestOutput:
        """A request that cannot start after all, answered with a 400 naming `param`."""
        self._forget(request)
        error = RequestError(ErrorCode.INVALID_REQUEST, message, param)
        return self.output.finish(request, FinishReason.ERROR, error=error)

    def _process(self, sampled: list[Sampled]) -> list[RequestOutput]:
        logprobs = {}
        if self.logprob_requests:
            rows = [(r, s.token, s.logits) for s in sampled if (r := self.by_uid.get(s.uid))]
            logprobs = self.output.sampled_logprobs(rows)
        outputs: list[RequestOutput] = []
        fresh: list[int] = []  # a long new prompt just prefilled: its KV may serve others
        kept: list[tuple[Any, list[int]]] = []  # caches for the prefix cache
        ended: dict[int, Request] = {}  # finished here, still in the backend's batch, by uid
        for s in sampled:
            request = self.by_uid.get(s.uid)
            if request is None:
                continue
            output = self.output.on_token(request, s.token, logprobs.get(request.request_id))
            if request.status is not RequestStatus.FINISHED and s.ended:  # the backend's limit
                last = self.output.finish(request, FinishReason.LENGTH, flush=True)
                output.text += last.text
                output.finish_reason, output.usage = last.finish_reason, last.usage
            outputs.append(output)
            # its first token here (a continuation's count starts at the tokens it resumed)
            first = request.completion_tokens == request.resumed + 1
            if first and self._worth_a_snapshot(request):
                fresh.append(s.uid)
            if request.status is RequestStatus.FINISHED:
                if s.ended:
                    if s.cache is not None and s.tokens is not None:
                        kept.append((s.cache, request.keyed(s.tokens)))
                elif request.uid is not None:
                    ended[request.uid] = request
                self._forget(request)
        if ended or kept or (fresh and self.prefix_cache is not None):
            self.unsettled = Unsettled(ended, fresh, kept)
        return outputs

    def settle(self) -> None:
        """What the last step put off until its outputs went out: the rows that finished
        there leave the batch, and their KV (and a long new prompt's, just prefilled) goes
        into the prefix cache. The worker calls it once a step's outputs are sent (a turn's
        last delta need not wait for its KV's copy: milliseconds of host work on a GPU);
        a step and an abort call it first, so the batch never steps a finished row and a
        lookup sees what the last step stored."""
        unsettled, self.unsettled = self.unsettled, None
        if unsettled is None:
            return
        kept = unsettled.kept
        if unsettled.ended:
            keep = self.prefix_cache is not None
            removed = self.backend.remove(list(unsettled.ended), keep_caches=keep)
            kept += self._keyed(removed, unsettled.ended)
        fresh = [uid for uid in unsettled.fresh if uid in self.by_uid]
        if fresh and self.prefix_cache is not None:
            kept += self._keyed(self.backend.extract(fresh))
            for uid in fresh:
                if self.plan is not None:
                    self.plan.prefilled(self.by_uid[uid].request_id)
        self._store(kept)

    def _worth_a_snapshot(self, request: Request) -> bool:
        return (
            request.status is RequestStatus.RUNNING
            and len(request.prompt) - request.cached_tokens >= SNAPSHOT_TOKENS
        )

    def _keyed(
        self, caches: dict[int, tuple[Any, list[int]]], gone: dict[int, Request] | None = None
    ) -> list[tuple[Any, list[int]]]:
        """Rows' caches with their tokens as the prefix cache keys them (images by content)."""
        pairs = []
        for uid, (cache, tokens) in caches.items():
            request = self.by_uid.get(uid) or (gone or {}).get(uid)
            pairs.append((cache, request.keyed(tokens) if request is not None else tokens))
        return pairs

    def _store(self, caches: Any) -> None:
        if self.prefix_cache is None:
            return
        pairs = list(caches)
        if pairs:
            self.backend.compact([cache for cache, _ in pairs])
        for cache, tokens in pairs:
            oversize = self.prefix_cache.oversize
            self.prefix_cache.insert(list(tokens), cache)
            if self.prefix_cache.oversize > oversize and not self._told_oversize:
                self._told_oversize = True  # once: the metric counts them all
                log.warning(
                    "prefix cache: the KV of a %d-token request (%.2f GiB) is larger than the "
                    "cache's bound (%.2f GiB) and is not kept; its next turn prefills it all "
                    "again (engine.prefix_cache_gb)",
                    len(tokens),
                    self.backend.nbytes(cache) / 2**30,
                    self.prefix_cache.capacity / 2**30,
                )

    def _forget(self, request: Request) -> None:
        self.requests.pop(request.request_id, None)
        if self.plan is not None:
            self.plan.prefilled(request.request_id)
        if request.uid is not None and self.by_uid.pop(request.uid, None) is not None:
            self.logprob_requests -= request.wants_logprobs
        self.scheduler.finish(request.request_id)

    # ---- prompt scoring (echo + logprobs) ------------------------------------------------

    def _score_step(self) -> list[RequestOutput]:
        """One prefill-sized chunk of the oldest scoring job: each prompt token's logprob
        given the tokens before it (the first has none). A finished job is queued for
        generation, or, with max_tokens 0, answered."""
        request_id, job = next(iter(self.scoring.items()))
        request = job.request
        prompt = request.prompt
        last = len(prompt) - 1  # positions 0..last-1 predict tokens 1..last
        if job.position < last:
            end = min(job.position + max(1, self.options.prefill_step_size), last)
            rows = self.backend.forward_logprobs(prompt[job.position : end], job.cache)
            targets = prompt[job.position + 1 : end + 1]
            job.entries += self.output.entries(rows, targets, request.sampling.top_logprobs)
            job.position = end
        if job.position < last:
            return []
        del self.scoring[request_id]
        del self.requests[request_id]
        request.prompt_logprobs = job.entries
        request.status = RequestStatus.WAITING
        answered = self._queue(request)
        return [answered] if answered is not None else []

    def score(self, prompt: list[int], top: int) -> list[TokenLogprob]:
        """All of a prompt's logprobs at once (tests and tools; requests score a chunk per
        step)."""
        request = Request("__score__", prompt, 0, SamplingParams(logprobs=True, top_logprobs=top))
        job = Scoring(
            request, [self.output.first_prompt_entry(prompt[0])], self.backend.new_cache()
        )
        cache = job.cache
        if len(prompt) > 1:
            rows = self.backend.forward_logprobs(prompt[:-1], cache)
            job.entries += self.output.entries(rows, prompt[1:], top)
        return job.entries

    def probe(self, max_steps: int = 64, prepared: PreparedRequest | None = None) -> None:
        """Generate greedy tokens through the real batch: Ready means this worked.
        `prepared`: a request of its own to probe with (an image, for a vision model).

        Without one, the probe takes the paths a served batch takes: two prompts of
        different lengths arrive together (one padded group), a third joins them while they
        decode, and they leave one by one (the batch compacts). On MLX's CUDA backend the
        first use of an operation compiles its kernels, seconds each for the gathers these
        paths run: here they are compiled at load, not in the first requests that take
        them (docs/benchmarks.md)."""
        later: list[PreparedRequest] = []
        if prepared is None:
            encode = self.backend.tokenizer.encode
            sampling = SamplingParams(temperature=0.0, ignore_eos=True)
            short = list(encode("Hi")) or [0]
            longer = list(encode("Hello, who is there?")) or [0]
            if len(longer) <= len(short):
                longer = short + short[-1:] * 2
            probes = [
                PreparedRequest("__probe__", short, 1, sampling),
                PreparedRequest("__probe_longer__", longer, 6, sampling),
            ]
            later = [PreparedRequest("__probe_joining__", list(encode("Hey")) or [0], 2, sampling)]
        else:
            prepared.request_id = "__probe__"
            probes = [prepared]
        expected = {p.request_id: p.max_tokens for p in probes + later}
        for probe in probes:
            self.add(probe)
        for _ in range(max_steps):
            for output in self.step():
                if output.request_id not in expected or output.finish_reason is None:
                    continue
                if output.error is not None:
                    self.abort(list(expected))
                    raise RuntimeError(f"the probe failed: {output.error.message}")
                wanted = expected.pop(output.request_id)
                made = output.usage.completion_tokens if output.usage is not None else 0
                if made != wanted:
                    self.abort(list(expected))
                    raise RuntimeError(f"the probe finished with {made} of {wanted} tokens")
            for probe in later:  # after the first step: the others are in the batch
                self.add(probe)
            later = []
            if not expected:
                self.settle()  # the last rows leave the batch, their KV stored
                if self.prefix_cache is not None:
                    self.prefix_cache.clear()  # the probe's KV is no one's prefix
                return
        self.abort(list(expected))
        raise RuntimeError(f"the probe did not finish within {max_steps} engine steps")


@dataclass(slots=True, eq=False)
class Scoring:
    """An echo + logprobs request whose prompt is being scored before it is queued."""

    request: Request
    entries: list[TokenLogprob]
    cache: Any
    position: int = 0  # the next prompt position to run


@dataclass(slots=True, eq=False)
class Unsettled:
    """A step's work on its finished rows, put off until its outputs are out (settle)."""

    ended: dict[int, Request]  # finished there, still in the backend's batch, by uid
    fresh: list[int]  # a long new prompt just prefilled: its KV may serve others
    kept: list[tuple[Any, list[int]]]  # caches for the prefix cache, with their tokens
