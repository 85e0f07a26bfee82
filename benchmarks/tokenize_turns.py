"""A chat prompt's tokenization as an agent's conversation grows: whole, and by segments.

    python -m benchmarks.tokenize_turns MODEL [--tokens 5000,25000] [--system 4000]
                                              [--user 150] [--answer 60] [--repeats 7]
                                              [--out FILE.json]

An agent-like conversation with MODEL's tokenizer and chat template: a system prompt of
about `--system` tokens, then turns of a user or tool-result message of about `--user`
tokens and an answer of about `--answer` tokens, each request ending with the newest
message. At the first turn whose prompt reaches each of `--tokens`, the median of
`--repeats` runs of:
- `render_ms`: the chat template rendered to text;
- `encode_ms`: that text encoded whole;
- `template_ms`: the template's own ids (rendered and encoded whole: the worker's path
  without segments);
- `segments_ms`: the text by segments (worker/prompt_segments.py), the memo as the
  previous turn's request left it: cut, looked up, the new segments (`new` of `segments`)
  encoded in one batch;
- `after_ms`: render_ms + segments_ms, what the worker's path with segments costs.
`same` says whether the segments' ids are the template's. Prints a table, and its rows as
JSON to `--out`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._prompts import filler, fit_words
from benchmarks.engine_steps import positive_ints

Message = dict[str, str]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tokenize_turns", description=__doc__)
    p.add_argument("model", help="a model directory with a tokenizer and a chat template")
    p.add_argument("--tokens", type=positive_ints, default=[5000, 25000], help="prompt sizes")
    p.add_argument("--system", type=int, default=4000, help="system prompt tokens")
    p.add_argument("--user", type=int, default=150, help="user / tool message tokens")
    p.add_argument("--answer", type=int, default=60, help="assistant answer tokens")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", type=Path, default=None, help="JSON results file")
    args = p.parse_args(argv)
    if min(args.system, args.user, args.answer, args.repeats) < 1:
        p.error("--system, --user, --answer and --repeats must be at least 1")
    args.tokens = sorted(args.tokens)
    return args


def median_ms(
    run: Callable[[], Any], repeats: int, before: Callable[[], Any] | None = None
) -> float:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        run()
        times.append(1000 * (time.perf_counter() - start))
    return round(statistics.median(times), 3)


class Conversation:
    """The agent's messages, grown a turn at a time (lengths fitted with the tokenizer)."""

    def __init__(self, tokenizer: Any, args: argparse.Namespace) -> None:
        self.tokenizer, self.args = tokenizer, args
        head = "You are a software agent. Use the tools; keep replies short. Notes: "
        system = self._fit(head, "system", args.system)
        self.messages: list[Message] = [{"role": "system", "content": system}]
        self.turn = 0

    def _fit(self, head: str, seed: str, target: int) -> str:
        def count(text: str) -> int:
            return len(self.tokenizer.encode(text, add_special_tokens=False))

        return fit_words(lambda n: head + filler(seed, n), target, count)

    def next(self) -> list[Message]:
        """The next request: the last one's answered, and a new message."""
        if self.turn:
            answer = self._fit(f"Step {self.turn}: ", f"answer:{self.turn}", self.args.answer)
            self.messages.append({"role": "assistant", "content": answer})
        self.turn += 1
        head = "Task: " if self.turn == 1 else f"Tool result {self.turn}: "
        text = self._fit(head, f"user:{self.turn}", self.args.user)
        self.messages.append({"role": "user", "content": text})
        return list(self.messages)


def measure(
    tokenizer: Any, segments: Any, previous: list[Message], messages: list[Message], repeats: int
) -> dict[str, Any]:
    from worker.prompt_segments import token_ids

    def render(conversation: list[Message]) -> str:
        text = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False
        )
        return str(text)

    def template() -> list[int]:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return token_ids(ids)

    text, last = render(messages), render(previous)

    def warm() -> None:  # the memo as the previous turn's request left it
        segments.clear()
        segments.lookup(segments.split(last))

    def by_segments() -> list[int]:
        ids: list[int] = segments.lookup(segments.split(text))
        return ids

    expected = template()
    warm()
    encoded = segments.stats.misses
    got = by_segments()
    row: dict[str, Any] = {"tokens": len(expected), "messages": len(messages)}
    row["segments"] = len(segments.split(text))
    row["new"] = segments.stats.misses - encoded
    row["render_ms"] = median_ms(lambda: render(messages), repeats)
    row["encode_ms"] = median_ms(lambda: tokenizer.encode(text, add_special_tokens=False), repeats)
    row["template_ms"] = median_ms(template, repeats)
    row["segments_ms"] = median_ms(by_segments, repeats, before=warm)
    row["after_ms"] = round(row["render_ms"] + row["segments_ms"], 3)
    row["same"] = got == expected
    return row


def table(rows: list[dict[str, Any]]) -> str:
    head = ("tokens", "messages", "render", "encode", "template", "segments", "new/all", "after")
    lines = ["  ".join(f"{h:>10}" for h in head) + "   (ms; same ids)"]
    for r in rows:
        cells = (
            r["tokens"],
            r["messages"],
            r["render_ms"],
            r["encode_ms"],
            r["template_ms"],
            r["segments_ms"],
            f"{r['new']}/{r['segments']}",
            r["after_ms"],
        )
        lines.append("  ".join(f"{c:>10}" for c in cells) + f"   {r['same']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from worker.prompt_segments import prompt_segments

    tokenizer = load_tokenizer(Path(args.model))
    segments = prompt_segments(tokenizer, shadow_checks=0)
    if segments is None:
        print("this model's chat prompts are tokenized whole (the worker's log says why)")
        return 1
    conversation = Conversation(tokenizer, args)
    rows: list[dict[str, Any]] = []
    previous = conversation.next()
    pending = list(args.tokens)
    while pending:
        messages = conversation.next()
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        length = len(segments.lookup(segments.split(text)))  # the same ids, sooner
        if length >= pending[0]:
            rows.append(measure(tokenizer, segments, previous, messages, args.repeats))
            while pending and length >= pending[0]:
                pending.pop(0)
        previous = messages
    print(table(rows))
    if args.out is not None:
        args.out.write_text(json.dumps({"model": args.model, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
