"""Unique, fixed-length chat prompts.

Each prompt starts with its own request id, so no two requests share more than the chat
template's preamble and prefix caches cannot turn the benchmark into a cache benchmark.
When a tokenizer is available the filler is trimmed or extended until the chat-templated
prompt is ``target`` tokens long (or the nearest length reachable by whole words).
"""

from __future__ import annotations

import random
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_WORD_TEXT = (
    "the model reads a prompt and writes tokens one by one while the server streams them"
    " back over a socket to each client that waits in a queue for its turn on the device"
    " batch cache worker gateway request reply stream token prompt layer weight matrix"
    " river stone light cloud paper window garden market winter summer number letter"
    " quiet rapid simple early later yellow purple silver golden narrow"
)
WORDS = tuple(_WORD_TEXT.split())

# Words per token is tokenizer dependent; this only seeds the search.
WORDS_PER_TOKEN_GUESS = 0.7

Counter = Callable[[str], int]


def filler(seed: str, n_words: int) -> str:
    """``n_words`` words drawn from one sequence seeded by ``seed``: the text for n words is
    a prefix of the text for n + 1."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(max(n_words, 0)))


def _text(index: int, tag: str, n_words: int) -> str:
    return f"Request {tag}-{index}: " + filler(f"{tag}:{index}", n_words)


def fit_words(text_of: Callable[[int], str], target: int, count: Counter | None) -> str:
    """``text_of(n)`` for the largest word count n whose ``count`` is <= ``target`` (a guess
    from WORDS_PER_TOKEN_GUESS without a counter). ``text_of(n)`` must be a prefix of
    ``text_of(n + 1)``, so the length is non-decreasing in n and can be binary-searched."""
    guess = max(int(target * WORDS_PER_TOKEN_GUESS), 1)
    if count is None:
        return text_of(guess)
    lo, hi = 0, guess  # every loop is bounded
    for _ in range(20):
        if count(text_of(hi)) > target:
            break
        lo, hi = hi, hi * 2
    for _ in range(40):
        if hi - lo <= 1:
            break
        mid = (lo + hi) // 2
        if count(text_of(mid)) <= target:
            lo = mid
        else:
            hi = mid
    return text_of(lo)


def make_prompt(index: int, tag: str, target: int, count: Counter | None) -> str:
    """One prompt. ``count(text)`` gives the templated token length, if known."""
    return fit_words(lambda n: _text(index, tag, n), target, count)


def make_prompts(
    start: int, count_n: int, tag: str, target: int, count: Counter | None
) -> list[str]:
    return [make_prompt(start + i, tag, target, count) for i in range(count_n)]


def chat_token_counter(model_path: str | Path) -> tuple[Counter, Callable[[str], list[int]]]:
    """Token counting and encoding with mlx_lm's tokenizer and chat template for a model dir."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(Path(model_path))

    def encode(text: str) -> list[int]:
        messages = [{"role": "user", "content": text}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def count(text: str) -> int:
        return len(encode(text))

    return count, encode


def lengths(prompts: Sequence[str], count: Counter | None) -> list[int | None]:
    return [count(p) if count else None for p in prompts]


def n_requests(args: Any, c: int) -> int:
    return args.requests if args.requests else max(4 * c, args.min_requests)


class PromptBank:
    """Unique prompts: every (job, level, repeat) gets its own tag, hence its own texts."""

    def __init__(self, args: Any, tokenizer_dir: str | None) -> None:
        self.args = args
        self.nonce = secrets.token_hex(3)
        self.count: Counter | None = None
        if tokenizer_dir:
            self.count, _ = chat_token_counter(tokenizer_dir)
        self.warmup = make_prompt(0, f"{self.nonce}w", args.prompt_tokens, self.count)

    def get(self, job_index: int, c: int, repeat: int, attempt: int = 0) -> list[str]:
        """A level's prompts; each attempt (a level measured again) gets fresh ones, so
        that no server's prompt cache sees them twice."""
        tag = f"{self.nonce}j{job_index}c{c}r{repeat}" + (f"a{attempt}" if attempt else "")
        n = n_requests(self.args, c)
        return make_prompts(0, n, tag, self.args.prompt_tokens, self.count)
