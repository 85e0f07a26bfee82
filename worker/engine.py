"""EngineCore: continuous batching over mlx-lm's public BatchGenerator API.

No sockets here: the daemon feeds it PreparedRequests and aborts, and ships what step()
returns. Requests join and leave the running batch between steps; BatchGenerator decodes the
running batch first and then prefills at most `prefill_step_size` prompt tokens, so a long
prompt never freezes running streams.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.generate import BatchGenerator, StopSequences

from shared.config import EngineOptions
from shared.types import FinishReason, RequestOutput, SamplingParams
from worker.preprocess import PreparedRequest
from worker.request import Request
from worker.sampling import make_processors, make_sampler
from worker.stop import StopStringMatcher


class EngineCore:
    def __init__(self, model: Any, tokenizer: Any, options: EngineOptions) -> None:
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
        self.requests: dict[str, Request] = {}
        self._by_uid: dict[int, Request] = {}
        self._eos_stops = StopSequences([[t] for t in sorted(self.eos_ids)])
        self.steps = 0
        self.batch_count = 0  # batch-priority requests in the generator

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

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
        return len(self.requests) - waiting, waiting

    def add(self, prepared: PreparedRequest) -> None:
        params = prepared.sampling
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        stops = (
            self._eos_stops
            if stop_ids == self.eos_ids
            else StopSequences([[t] for t in sorted(stop_ids)])
        )
        (uid,) = self.generator.insert(
            [prepared.prompt],
            max_tokens=[prepared.max_tokens],
            samplers=[make_sampler(params, self.vocab_size)],
            logits_processors=[make_processors(params, stop_ids)],
            stop_sequences=[stops],
        )
        request = Request(
            request_id=prepared.request_id,
            uid=uid,
            prompt_len=len(prepared.prompt),
            max_tokens=prepared.max_tokens,
            detokenizer=self.tokenizer.detokenizer,
            decode=self.tokenizer.decode,
            stop=StopStringMatcher(params.stop, params.include_stop_str_in_output),
            priority=prepared.priority,
        )
        self.batch_count += prepared.priority > 0
        self.requests[request.request_id] = request
        self._by_uid[uid] = request

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        """Remove requests from the batch (their KV goes with them); idempotent."""
        found = [self.requests[i] for i in request_ids if i in self.requests]
        if not found:
            return []
        self.generator.remove([r.uid for r in found])
        for request in found:
            self._forget(request)
        return [r.finish(FinishReason.ABORT) for r in found]

    def step(self) -> list[RequestOutput]:
        _, responses = self.generator.next()
        self.steps += 1
        outputs: list[RequestOutput] = []
        early: list[int] = []
        for response in responses:
            request = self._by_uid.get(response.uid)
            if request is None:
                continue
            output = request.on_token(response.token, response.finish_reason == "stop")
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
        self._by_uid.pop(request.uid, None)
