"""EngineCore: continuous batching over mlx-lm's public BatchGenerator API.

No sockets here: the daemon feeds it PreparedRequests and aborts, and ships what step()
returns. Requests join and leave the running batch between steps; BatchGenerator decodes the
running batch first and then prefills at most `prefill_step_size` prompt tokens, so a long
prompt never freezes running streams.

New requests enter the generator a group at a time, and the next group only once every
request of the previous one has its first token (a group with a prompt longer than one
prefill step does not hold the next one back): BatchGenerator returns a step's tokens
after that step's prefill, so a burst inserted at once holds every first token until the
whole burst is prefilled. A burst that starts an idle batch goes in as
`burst_prefill_groups` groups (two by default): the first group streams after its share of
the prefill. Only a burst larger than the running batch is split: one that starts an idle
batch, or the rest of a wave whose first request was admitted alone (its clients connected a
few milliseconds late). Splitting every returning group again would fragment a batch into
ever smaller groups, each paying its own prefill and KV merge: a returning group, no larger
than the requests running beside it, goes in whole (the daemon holds a partly arrived one
together).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.models.cache import make_prompt_cache

from shared.config import EngineOptions
from shared.types import (
    FinishReason,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from worker.batching import attach
from worker.preprocess import PreparedRequest
from worker.request import Request
from worker.sampling import make_processors, make_sampler
from worker.stop import StopStringMatcher
from worker.tokens import TokenInfo

MIN_GROUP = 4  # a group smaller than this costs more per prompt than its first tokens gain


class EngineCore:
    def __init__(self, model: Any, tokenizer: Any, options: EngineOptions) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.options = options
        self.eos_ids = frozenset(tokenizer.eos_token_ids)
        self.vocab_size = len(tokenizer)
        self.generator = BatchGenerator(
            model,
            completion_batch_size=options.max_running,
            prefill_batch_size=min(options.prefill_batch_size, options.max_running),
            prefill_step_size=options.prefill_step_size,
        )
        # The running batch skips the vocabulary log-softmax while no request in the engine
        # reads it (worker/batching.py); these requests need it.
        self._lean = attach(self.generator)
        self._normalized: set[str] = set()
        self.requests: dict[str, Request] = {}
        # echo + logprobs: the prompt is scored first, one prefill-sized chunk per step()
        # (so running streams keep moving), then the request joins the batch.
        self.scoring: dict[str, Scoring] = {}
        self._by_uid: dict[int, Request] = {}
        self.max_group = max(1, min(options.prefill_batch_size, options.max_running))
        # accepted, not yet in the generator (their Request.uid is -1)
        self.staged: deque[Staged] = deque()
        self._awaiting: set[int] = set()  # uids in the generator without a first token
        # a burst being split into groups: how many of its requests and groups are left
        self._split_left = self._split_groups = 0
        self._eos_stops = StopSequences([[t] for t in sorted(self.eos_ids)])
        self.steps = 0
        self.batch_count = 0  # batch-priority requests in the generator
        self.logprob_count = 0  # requests that want logprobs: 0 keeps step() free of them
        self.tokens = TokenInfo(tokenizer)

    @property
    def has_work(self) -> bool:
        return bool(self.requests or self.scoring)

    @property
    def active(self) -> int:
        """Requests the engine holds: in the batch, or having their prompt scored first."""
        return len(self.requests) + len(self.scoring)

    def request_ids(self) -> list[str]:
        return [*self.requests, *self.scoring]

    def probe(self, max_steps: int = 64) -> None:
        """Generate one greedy token through the real batch: Ready means this worked."""
        request_id = "__probe__"
        prompt = list(self.tokenizer.encode("Hi")) or [0]
        sampling = SamplingParams(temperature=0.0, ignore_eos=True)
        self.add(PreparedRequest(request_id, prompt, 1, sampling))
        for _ in range(max_steps):
            for output in self.step():
                if output.request_id != request_id or output.finish_reason is None:
                    continue
                if output.error is not None:
                    raise RuntimeError(f"the probe failed: {output.error.message}")
                if output.usage is None or output.usage.completion_tokens != 1:
                    raise RuntimeError("the probe finished without generating a token")
                return
        self.abort([request_id])
        raise RuntimeError(f"the probe generated no token within {max_steps} engine steps")

    def ending_within(self, steps: int) -> bool:
        """True when every request will reach its max_tokens within `steps` steps."""
        if steps <= 0 or not self.requests:
            return False
        return all(
            r.completion_tokens > 0 and r.max_tokens - r.completion_tokens <= steps
            for r in self.requests.values()
        )

    def counts(self) -> tuple[int, int]:
        """(running, waiting): waiting requests have not produced a token yet."""
        waiting = sum(1 for r in list(self.requests.values()) if r.completion_tokens == 0)
        return len(self.requests) - waiting, waiting + len(self.scoring)

    def add(self, prepared: PreparedRequest) -> RequestOutput | None:
        """Into the batch (an echo request with logprobs has its prompt scored first); an
        echo request with max_tokens 0 that needs no scoring is answered here."""
        params = prepared.sampling
        prompt_text = self.tokenizer.decode(prepared.prompt) if params.echo else None
        if params.echo and params.logprobs:
            first = prepared.prompt[0]
            entry = TokenLogprob(first, self.tokens.text(first), token_bytes=self.tokens.raw(first))
            self.scoring[prepared.request_id] = Scoring(
                prepared, prompt_text or "", [entry], make_prompt_cache(self.model)
            )
            return None
        return self._start(prepared, prompt_text, None)

    def _start(
        self,
        prepared: PreparedRequest,
        prompt_text: str | None,
        prompt_logprobs: list[TokenLogprob] | None,
    ) -> RequestOutput | None:
        params = prepared.sampling
        if prepared.max_tokens == 0:
            return RequestOutput(
                prepared.request_id,
                finish_reason=FinishReason.LENGTH,
                usage=Usage(prompt_tokens=len(prepared.prompt)),
                prompt_logprobs=prompt_logprobs or [],
                prompt_text=prompt_text,
            )
        if not prepared.prompt:  # refused here, alone: the generator would fail a group
            raise ValueError("the prompt is empty")
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        stops = (
            self._eos_stops
            if stop_ids == self.eos_ids
            else StopSequences([[t] for t in sorted(stop_ids)])
        )
        request = Request(
            request_id=prepared.request_id,
            uid=-1,
            prompt_len=len(prepared.prompt),
            max_tokens=prepared.max_tokens,
            detokenizer=self.tokenizer.detokenizer,
            decode=self.tokenizer.decode,
            stop=StopStringMatcher(params.stop, params.include_stop_str_in_output),
            priority=prepared.priority,
            logprobs=params.logprobs,
            top_logprobs=params.top_logprobs,
            stop_logprob=params.echo,
            prompt_text=prompt_text,
            prompt_logprobs=prompt_logprobs,
        )
        self.batch_count += prepared.priority > 0
        self.logprob_count += params.logprobs
        if params.logprobs or 0 < params.top_p < 1:  # top-p exponentiates its input
            self._normalized.add(request.request_id)
        self.requests[request.request_id] = request
        self.staged.append(
            Staged(
                request,
                prepared.prompt,
                make_sampler(params, self.vocab_size),
                make_processors(params, stop_ids),
                stops,
            )
        )
        return None

    def _insert_group(self) -> None:
        """The next group of staged requests into the generator, once the previous group
        has its first tokens."""
        if not self.staged or self._awaiting:
            return
        size = self.max_group
        burst = len(self.staged)
        if not self._split_left and burst >= 2 * MIN_GROUP and burst > len(self._by_uid):
            # balanced groups of at least MIN_GROUP: 13 in three is 5 + 4 + 4, 10 is 5 + 5
            self._split_groups = min(self.options.burst_prefill_groups, burst // MIN_GROUP)
            self._split_left = burst
        self._split_left = min(self._split_left, burst)  # fewer, if some were aborted
        if self._split_groups > 1 and self._split_left > 0:
            size = min(size, -(-self._split_left // self._split_groups))
        group = [self.staged.popleft() for _ in range(min(size, len(self.staged)))]
        self._split_left = max(0, self._split_left - len(group))
        self._split_groups = max(0, self._split_groups - 1)
        uids = self.generator.insert(
            [s.prompt for s in group],
            max_tokens=[s.request.max_tokens for s in group],
            samplers=[s.sampler for s in group],
            logits_processors=[s.processors for s in group],
            stop_sequences=[s.stops for s in group],
        )
        for staged, uid in zip(group, uids, strict=True):
            staged.request.uid = uid
            self._by_uid[uid] = staged.request
            # A prompt longer than a prefill step takes several steps: requests behind it
            # join it in the generator's prompt batch rather than wait for all of it.
            if len(staged.prompt) <= self.options.prefill_step_size:
                self._awaiting.add(uid)

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        """Remove requests from the batch (their KV goes with them); idempotent."""
        outputs = [
            RequestOutput(
                job.prepared.request_id,
                finish_reason=FinishReason.ABORT,
                usage=Usage(prompt_tokens=len(job.prepared.prompt)),
            )
            for i in request_ids
            if (job := self.scoring.pop(i, None)) is not None
        ]
        found = [self.requests[i] for i in request_ids if i in self.requests]
        if not found:
            return outputs
        if any(r.uid < 0 for r in found):
            gone = {r.request_id for r in found}
            self.staged = deque(s for s in self.staged if s.request.request_id not in gone)
            if not self.staged:  # no burst left to split
                self._split_left = self._split_groups = 0
        inserted = [r.uid for r in found if r.uid >= 0]
        if inserted:
            self.generator.remove(inserted)
        for request in found:
            self._forget(request)
        return outputs + [r.finish(FinishReason.ABORT) for r in found]

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        outputs: list[RequestOutput] = []
        if self.scoring:
            started = self._score_step()
            if started is not None:
                outputs.append(started)
        self._insert_group()
        if not self._by_uid:
            return outputs
        if self._lean is not None:
            self._lean.normalize = bool(self._normalized)
        _, responses = self.generator.next()
        if self._awaiting:
            self._awaiting.difference_update(r.uid for r in responses)
        early: list[int] = []
        logprobs = self._logprobs(responses) if self.logprob_count else None
        for response in responses:
            request = self._by_uid.get(response.uid)
            if request is None:
                continue
            output = request.on_token(
                response.token,
                response.finish_reason == "stop",
                logprobs.get(response.uid) if logprobs else None,
            )
            if request.finished:
                self._forget(request)
                if response.finish_reason is None:  # a stop string: still in the batch
                    early.append(response.uid)
            if output is not None:
                outputs.append(output)
        if early:
            self.generator.remove(early)
        return outputs

    def _forget(self, request: Request) -> None:
        if self.requests.pop(request.request_id, None) is not None:
            self.batch_count -= request.priority > 0
            self.logprob_count -= request.logprobs
            self._normalized.discard(request.request_id)
        self._by_uid.pop(request.uid, None)
        self._awaiting.discard(request.uid)

    # ---- log probabilities ------------------------------------------------------------

    def _top(self, token: int, logprob: float) -> TopLogprob:
        return TopLogprob(token, self.tokens.text(token), logprob, self.tokens.raw(token))

    def _logprobs(self, responses: list[Any]) -> dict[int, TokenLogprob]:
        """The sampled tokens' logprobs (mlx-lm's log-softmax of the processed logits, the
        distribution the sampler drew from before temperature), for the requests that asked,
        in one batched computation."""
        want = [
            (r, req)
            for r in responses
            if (req := self._by_uid.get(r.uid)) is not None and req.logprobs
        ]
        if not want:
            return {}
        rows = mx.stack([r.logprobs for r, _ in want]).astype(mx.float32)
        tokens = [r.token for r, _ in want]
        top = max(req.top_logprobs for _, req in want)
        entries = self._entries(rows, tokens, top)
        return {
            r.uid: _trim(entry, req.top_logprobs)
            for (r, req), entry in zip(want, entries, strict=True)
        }

    def _entries(self, rows: mx.array, tokens: list[int], top: int) -> list[TokenLogprob]:
        """rows: (n, vocab) log probabilities; tokens: the token at each row."""
        chosen = mx.take_along_axis(rows, mx.array(tokens)[:, None], axis=-1)[:, 0]
        top = min(top, rows.shape[-1])
        top_ids: list[list[int]] = []
        top_vals: list[list[float]] = []
        if top:
            idx = mx.argpartition(-rows, kth=top - 1, axis=-1)[:, :top]
            vals = mx.take_along_axis(rows, idx, axis=-1)
            mx.eval(chosen, idx, vals)
            top_ids, top_vals = cast(Any, idx.tolist()), cast(Any, vals.tolist())
        chosen_vals: list[float] = cast(Any, chosen.tolist())
        entries = []
        for i, token in enumerate(tokens):
            alternatives: list[TopLogprob] = []
            if top:
                ranked = sorted(
                    zip(top_vals[i], top_ids[i], strict=True), key=lambda p: (-p[0], p[1])
                )
                alternatives = [self._top(t, v) for v, t in ranked]
            entries.append(
                TokenLogprob(
                    token,
                    self.tokens.text(token),
                    chosen_vals[i],
                    alternatives,
                    self.tokens.raw(token),
                )
            )
        return entries

    def _score_step(self) -> RequestOutput | None:
        """One prefill-sized chunk of the oldest scoring job: each prompt token's logprob
        given the tokens before it (the first has none). A finished job joins the batch,
        or, with max_tokens 0, is answered."""
        request_id, job = next(iter(self.scoring.items()))
        prompt = job.prepared.prompt
        last = len(prompt) - 1  # positions 0..last-1 predict tokens 1..last
        if job.position < last:
            end = min(job.position + max(1, self.options.prefill_step_size), last)
            chunk = prompt[job.position : end]
            logits = self.model(mx.array(chunk)[None], cache=job.cache)[0].astype(mx.float32)
            rows = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            targets = prompt[job.position + 1 : end + 1]
            job.entries += self._entries(rows, targets, job.prepared.sampling.top_logprobs)
            job.position = end
        if job.position < last:
            return None
        del self.scoring[request_id]
        job.cache = None  # the batch prefills its own KV
        return self._start(job.prepared, job.prompt_text, job.entries)

    def score(self, prompt: list[int], top: int) -> list[TokenLogprob]:
        """All of a prompt's logprobs at once (tests and tools; requests use scoring jobs,
        a chunk per step)."""
        first = prompt[0]
        entry = TokenLogprob(first, self.tokens.text(first), token_bytes=self.tokens.raw(first))
        sampling = SamplingParams(logprobs=True, top_logprobs=top, echo=True)
        job = Scoring(
            PreparedRequest("__score__", prompt, 0, sampling),
            "",
            [entry],
            make_prompt_cache(self.model),
        )
        self.scoring = {"__score__": job, **self.scoring}
        while "__score__" in self.scoring:
            self._score_step()
        return job.entries


@dataclass(slots=True, eq=False)
class Staged:
    """A request accepted by the engine, waiting for its group's turn in the generator."""

    request: Request
    prompt: list[int]
    sampler: Any
    processors: Any
    stops: StopSequences


@dataclass(slots=True, eq=False)
class Scoring:
    """An echo + logprobs request whose prompt is being scored before it joins the batch."""

    prepared: PreparedRequest
    prompt_text: str
    entries: list[TokenLogprob]
    cache: Any
    position: int = 0  # the next prompt position to run


def _trim(entry: TokenLogprob, top: int) -> TokenLogprob:
    if len(entry.top) > top:
        entry.top = entry.top[:top]
    return entry
