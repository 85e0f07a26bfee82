"""The trace of an agent-session benchmark: what each session says, turn by turn.

One system prompt is shared by every session; each session has its own first user message
(a task) and, for each later turn, a new user message (a tool result). Turn ``t`` sends the
system prompt, the first ``t`` user messages and the ``t - 1`` replies that the server under
test returned (``Trace.messages``), so the prompt grows every turn and all but its last user
message was seen before: the shape that a prefix cache is for.

The system prompt starts with the trace's tag, so traces with different tags (one per repeat)
share only the chat template's first few tokens. Lengths are calibrated with the model's
tokenizer and chat template when one is given: the system prompt to ``system_tokens``
templated tokens, each user message to a length drawn from ``user_tokens`` (the same lengths
for every tag, so repeats are alike).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks._prompts import filler, fit_words

Message = dict[str, str]


@dataclass(frozen=True, slots=True)
class Trace:
    system: str
    users: tuple[tuple[str, ...], ...]  # users[session][turn - 1]

    @property
    def sessions(self) -> int:
        return len(self.users)

    @property
    def turns(self) -> int:
        return len(self.users[0]) if self.users else 0

    def messages(self, session: int, replies: Sequence[str]) -> list[Message]:
        """The request of turn ``len(replies) + 1`` of ``session``, given the replies so far."""
        users = self.users[session]
        if len(replies) >= len(users):
            raise ValueError(f"session {session} has only {len(users)} turns")
        out = [{"role": "system", "content": self.system}]
        for user, reply in zip(users, replies, strict=False):
            out += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        out.append({"role": "user", "content": users[len(replies)]})
        return out


class ChatTokens:
    """Token counts with a model's tokenizer and chat template (mlx_lm's loader)."""

    def __init__(self, model_dir: str | Path) -> None:
        from mlx_lm.tokenizer_utils import load as load_tokenizer

        self.tokenizer = load_tokenizer(Path(model_dir))

    def conversation(self, messages: list[Message], add_generation_prompt: bool = True) -> int:
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return len(ids)

    def system(self, text: str) -> int:
        """The templated length of a conversation that is only this system message."""
        return self.conversation([{"role": "system", "content": text}], False)

    def text(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))


def user_length(session: int, turn: int, bounds: tuple[int, int]) -> int:
    """The target length of a user message: fixed per (session, turn), whatever the tag."""
    return random.Random(f"user:{session}:{turn}").randint(*bounds)


def _fit(head: str, seed: str, target: int, count: Callable[[str], int] | None) -> str:
    return fit_words(lambda n: head + filler(seed, n), target, count)


def build_trace(
    tag: str,
    sessions: int,
    turns: int,
    system_tokens: int,
    user_tokens: tuple[int, int] = (100, 200),
    tokens: ChatTokens | None = None,
) -> Trace:
    """The trace for ``sessions`` sessions of ``turns`` turns (lengths are guesses when
    ``tokens`` is None)."""
    if sessions < 1 or turns < 1:
        raise ValueError("a trace needs at least one session and one turn")
    head = f"[{tag}] You are a software agent. Use the tools; keep replies short. Notes: "
    system = _fit(head, f"{tag}:system", system_tokens, tokens.system if tokens else None)
    count = tokens.text if tokens else None
    users = []
    for s in range(sessions):
        texts = []
        for t in range(1, turns + 1):
            head = f"Task {s}: " if t == 1 else f"Tool result {s}.{t}: "
            target = user_length(s, t, user_tokens)
            texts.append(_fit(head, f"{tag}:{s}:{t}", target, count))
        users.append(tuple(texts))
    return Trace(system, tuple(users))
