"""A chat prompt tokenized by segments, each segment's tokens kept for the next turn.

Every turn of a conversation re-sends all of it, and encoding the rendered template is most
of what preparing a long chat request costs (a 25k-token prompt: about 1 ms to render, 25-50
ms to encode on one core; by segments about 1 ms: benchmarks/tokenize_turns.py). Hugging
Face's `tokenizers` splits a text at its added tokens before it normalizes, pre-tokenizes and
models the pieces between them, so the text between two special tokens tokenizes on its own:
the prompt, cut where each special token starts, encodes as its segments' tokens end to end,
and a segment met before (every turn's but the newest few) is looked up instead of encoded.

The cut is made only at special tokens that match as written (not normalized, no stripping,
not single-word) and whose text starts and ends with a character that is neither a word's
nor a space, and only where no other added token could match across it. Equivalence is
checked, never assumed: at load a small conversation through the model's own template and a
text of special tokens and words are encoded both ways (`prompt_segments`), and the first
SHADOW_CHECKS prompts of two segments or more are encoded whole too. Any difference turns
segments off for the model, logged. A worker checks those prompts once the request is on its
way to the engine (`run_checks`, on its input thread): encoding a 5k-token conversation whole
again took 5-10 ms of a fresh worker's first cached agent turns, a third of their first
token's time on an H100 host. The request a difference is found in ran on its segments' ids
(its own text, cut where the whole encoding merged across a special token's edge); in a
sharded group, whose ranks prepare requests alike on their engine threads, the check comes
first and the prompt keeps its whole encoding.

Cost: the memo holds at most MEMO_BYTES (32 MiB) of segment text and token ids, counted as
Python holds them (`entry_bytes`: about 10 bytes a character of English text, more where a
token is a character or a byte), least recently used segments out first; a segment over a
sixteenth of that is encoded every time, never kept. Its figures go out in each heartbeat
(`segment_stats`), as the gateway's `mlxgw_prompt_segments_*` metrics.
"""

from __future__ import annotations

import itertools
import logging
import re
import sys
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shared.protocol import PromptSegmentStats

log = logging.getLogger(__name__)

MEMO_BYTES = 32 * 2**20
# What an entry costs besides its text and list: each id's int object (Python shares those up
# to 256 only) and the ordered dict's own bookkeeping of the key.
INT_BYTES = 28
ENTRY_BYTES = 100
# A segment that would take more than this share of the bound is not kept: one huge message
# would push every conversation's segments out.
LARGEST_SHARE = 16
SHADOW_CHECKS = 16
# apply_chat_template's own parameters that change how the rendered text is encoded (not
# template variables): a request that passes one is encoded whole.
ENCODING_KWARGS = frozenset({"sanitize_control_tokens"})

EncodeBatch = Callable[[list[str]], list[list[int]]]

# The probe: a conversation with the edges tokenizers treat specially (spaces and newlines
# at both ends, accents, digits, wide characters), rendered by the model's own template.
PROBE_MESSAGES = (
    {"role": "system", "content": "  You are a careful assistant.\n"},
    {"role": "user", "content": " Héllo wörld: 12345 ✓ 日本語 \n\n"},
    {"role": "assistant", "content": "\tSure, 3.14159 and 2 + 2 = 4.  "},
    {"role": "user", "content": "And now?\n "},
)


@dataclass(slots=True)
class SegmentStats:
    prompts: int = 0  # chat prompts tokenized by segments
    hits: int = 0  # segments found in the memo
    misses: int = 0  # segments encoded
    evicted: int = 0  # segments dropped from the memo for room
    shadow_checked: int = 0  # prompts taken to be encoded whole too, to compare


def entry_bytes(text: str, ids: list[int]) -> int:
    """What the memo holds for a segment, as Python holds it: the text, the list of ids and
    their int objects, the entry's bookkeeping."""
    return sys.getsizeof(text) + sys.getsizeof(ids) + INT_BYTES * len(ids) + ENTRY_BYTES


class SegmentMemo:
    """Segment text -> its token ids, least recently used out first, at most `max_bytes`
    (`entry_bytes`). Not locked: PromptSegments holds its lock around it."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._ids: OrderedDict[str, tuple[list[int], int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ids)

    def get(self, text: str) -> list[int] | None:
        entry = self._ids.get(text)
        if entry is None:
            return None
        self._ids.move_to_end(text)
        return entry[0]

    def put(self, text: str, ids: list[int]) -> int:
        """Keep `ids` for `text` (never one over a LARGEST_SHARE of the bound); the number
        evicted."""
        cost = entry_bytes(text, ids)
        if cost * LARGEST_SHARE > self.max_bytes or text in self._ids:
            return 0
        self._ids[text] = (ids, cost)
        self.nbytes += cost
        evicted = 0
        while self.nbytes > self.max_bytes:
            _, (_, old) = self._ids.popitem(last=False)
            self.nbytes -= old
            evicted += 1
        return evicted

    def clear(self) -> None:
        self._ids.clear()
        self.nbytes = 0


class PromptSegments:
    """A rendered prompt's token ids, from its segments' (the memo's, or encoded in one
    batch). `encode` is called from the input thread, and from the engine thread in a
    sharded group: the memo and the counts are behind a lock; encoding runs outside it."""

    def __init__(
        self,
        tokens: Sequence[str],
        encode_batch: EncodeBatch,
        memo_bytes: int = MEMO_BYTES,
        shadow_checks: int = SHADOW_CHECKS,
    ) -> None:
        if not tokens:
            raise ValueError("no tokens to cut at")
        self.tokens = sorted(set(tokens), key=len, reverse=True)
        self._cut = matcher(self.tokens)
        self._encode_batch = encode_batch
        self._memo = SegmentMemo(memo_bytes)
        self._lock = threading.Lock()
        # prompts served on their segments' ids, to be encoded whole too (run_checks)
        self._pending: deque[tuple[list[int], Callable[[], list[int]], str]] = deque()
        self.shadow_checks = shadow_checks
        self.stats = SegmentStats()
        self.off_reason: str | None = None

    @property
    def on(self) -> bool:
        return self.off_reason is None

    def split(self, text: str) -> list[str]:
        """The text cut where each special token starts (the first piece may have none)."""
        starts = [m.start() for m in self._cut.finditer(text)]
        if not starts or starts[0] != 0:
            starts.insert(0, 0)
        starts.append(len(text))
        return [text[a:b] for a, b in itertools.pairwise(starts) if b > a]

    def encode(
        self,
        text: str,
        whole: Callable[[], list[int]],
        request_id: str = "",
        check_later: bool = False,
    ) -> list[int]:
        """`text`'s token ids by segments; `whole()` (the text encoded whole) where segments
        are off, for the first prompts checked, and where they differ (then off for good).
        `check_later`: a prompt due for its check gets its segments' ids now and is checked
        by `run_checks`, once the request is on its way (off its first token's path)."""
        if not self.on:
            return whole()
        segments = self.split(text)
        try:
            ids = self.lookup(segments)
        except Exception as exc:  # the whole encoding still serves the request
            log.exception("tokenizing by segments failed; prompts are tokenized whole from now")
            self.turn_off(f"encoding by segments failed: {exc}")
            return whole()
        with self._lock:
            self.stats.prompts += 1
        if len(segments) < 2 or not self._shadow_due():
            return ids
        if check_later:
            with self._lock:
                self._pending.append((ids, whole, request_id))
            return ids
        return self._check(ids, whole, request_id)

    def run_checks(self) -> None:
        """The checks `encode(check_later=True)` left, in order (at most `shadow_checks`
        since the last `clear`). A difference turns segments off for later prompts; the
        request it was found in ran on its segments' ids (its text, cut differently). A
        whole encoding that fails is logged and leaves segments on: the request was served,
        and later prompts would meet the same failure without them."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                ids, whole, request_id = self._pending.popleft()
            if not self.on:
                continue
            try:
                self._check(ids, whole, request_id, ran=True)
            except Exception:  # the request is served already: nothing compared
                log.exception("request %s: its prompt's whole encoding failed", request_id or "?")

    def _check(
        self, ids: list[int], whole: Callable[[], list[int]], request_id: str, ran: bool = False
    ) -> list[int]:
        """The whole encoding, and segments off for good where `ids` differ from it."""
        expected = whole()
        if ids != expected:
            where = _first_difference(ids, expected)
            self.turn_off(f"request {request_id or '?'}'s prompt differed at token {where}")
            log.warning(
                "request %s: its prompt tokenized by segments differs from its whole encoding "
                "at token %d; this model's prompts are tokenized whole from now%s",
                request_id or "?",
                where,
                " (this one ran on its segments' ids)" if ran else "",
                extra={"request_id": request_id},
            )
        return expected

    def lookup(self, segments: Sequence[str]) -> list[int]:
        """The segments' ids end to end: the memo's, the rest encoded in one batch."""
        with self._lock:
            found = [self._memo.get(s) for s in segments]
        missing = list(dict.fromkeys(s for s, f in zip(segments, found, strict=True) if f is None))
        encoded = dict(zip(missing, self._encode_batch(missing), strict=True)) if missing else {}
        with self._lock:
            self.stats.hits += len(found) - found.count(None)
            self.stats.misses += len(missing)
            for text, ids in encoded.items() if self.on else ():  # (not after a turn_off)
                self.stats.evicted += self._memo.put(text, ids)
        out: list[int] = []
        for s, f in zip(segments, found, strict=True):
            out += encoded[s] if f is None else f
        return out

    def turn_off(self, reason: str) -> None:
        with self._lock:
            self.off_reason = reason
            self._memo.clear()

    def clear(self) -> None:
        """An empty memo and counts (after the probe, and for benchmarks)."""
        with self._lock:
            self._memo.clear()
            self._pending.clear()
            self.stats = SegmentStats()

    def memo_bytes(self) -> int:
        with self._lock:
            return self._memo.nbytes

    def snapshot(self) -> PromptSegmentStats:
        """The memo now and the counts since the last clear (a heartbeat's figures)."""
        with self._lock:
            memo, stats = self._memo, self.stats
            return PromptSegmentStats(
                len(memo),
                memo.nbytes,
                memo.max_bytes,
                stats.prompts,
                stats.hits,
                stats.misses,
                stats.evicted,
            )

    def _shadow_due(self) -> bool:
        """Whether this prompt is one of the first `shadow_checks` (counted as taken)."""
        with self._lock:
            due = self.stats.shadow_checked < self.shadow_checks
            self.stats.shadow_checked += due
            return due


def segment_stats(preprocess: Any) -> PromptSegmentStats | None:
    """A preprocessor's memo figures; None for one without segments (embeddings, speech,
    vision; the option off; a tokenizer that cannot be cut) or that turned them off."""
    segments = getattr(preprocess, "segments", None)
    return segments.snapshot() if isinstance(segments, PromptSegments) and segments.on else None


def whole_only(kwargs: Mapping[str, Any]) -> bool:
    """Whether these apply_chat_template kwargs change the encoding itself (no segments)."""
    return any(key in ENCODING_KWARGS and kwargs[key] for key in kwargs)


def prompt_segments(
    tokenizer: Any, memo_bytes: int = MEMO_BYTES, shadow_checks: int = SHADOW_CHECKS
) -> PromptSegments | None:
    """This model's PromptSegments, probed; None, logged with why, where its chat prompts
    must be encoded whole."""
    try:
        found = _probed(tokenizer, memo_bytes, shadow_checks)
    except Exception as exc:  # a tokenizer unlike any met: the whole encoding serves
        found = f"probing it failed: {exc!r}"
    if isinstance(found, str):
        log.info("chat prompts are tokenized whole: %s", found)
        return None
    return found


def cut_tokens(added: Iterable[Any]) -> list[str]:
    """The special tokens a prompt may be cut at: matched as written (not normalized, no
    stripping, not single-word), their text bounded by characters that are neither a
    word's nor a space (so that no neighbouring token's stripping or word test sees past
    the cut)."""
    return [
        t.content
        for t in added
        if t.special and not (t.normalized or t.lstrip or t.rstrip or t.single_word)
        if _bounded(t.content)
    ]


def crossing(added: Iterable[Any], tokens: Sequence[str]) -> str | None:
    """An added token that could match across a cut (it holds a cut token, or ends with the
    start of one), or None. Normalized tokens match only between the others: never across."""
    cut = matcher(tokens)
    starts = {token[:k] for token in tokens for k in range(1, len(token) + 1)}
    names = set(tokens)
    for t in added:
        text = t.content
        if t.normalized or text in names:
            continue
        if cut.search(text) or any(text[i:] in starts for i in range(1, len(text))):
            return str(text)
    return None


def _probed(tokenizer: Any, memo_bytes: int, shadow_checks: int) -> PromptSegments | str:
    if not getattr(tokenizer, "chat_template", None):
        return "the model has no chat template"
    if getattr(tokenizer, "split_special_tokens", False):
        return "its tokenizer encodes special tokens as text (split_special_tokens)"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch"):
        return "its tokenizer is not a fast (Hugging Face tokenizers) one"
    added = list(dict(getattr(tokenizer, "added_tokens_decoder", None) or {}).values())
    tokens = cut_tokens(added)
    if not tokens:
        return "its tokenizer has no special token to cut a prompt at"
    clash = crossing(added, tokens)
    if clash is not None:
        return f"its added token {clash!r} may match across a special token"

    def encode_batch(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]

    segments = PromptSegments(tokens, encode_batch, memo_bytes, shadow_checks)
    problem = probe(tokenizer, segments)
    if problem is not None:
        return problem
    segments.clear()
    return segments


def probe(tokenizer: Any, segments: PromptSegments) -> str | None:
    """Why this tokenizer's prompts encode differently by segments, or None: a small
    conversation through its chat template, and a text of special tokens and words."""
    rendered: tuple[Any, Any] | None = None
    problem: Exception | None = None
    for messages in (PROBE_MESSAGES, PROBE_MESSAGES[1:]):  # a template may take no system
        try:
            rendered = tuple(
                tokenizer.apply_chat_template(
                    [dict(m) for m in messages], add_generation_prompt=True, tokenize=tokenize
                )
                for tokenize in (False, True)
            )
            break
        except Exception as exc:
            problem = exc
    if rendered is None:
        return f"its chat template rejected the probe conversation ({problem})"
    text, whole = rendered
    if not isinstance(text, str):
        return "its chat template did not render text"
    if len(segments.split(text)) < 2:
        return "its chat template writes no special token to cut at"
    plain = "lead " + "".join(
        f"{t} Héllo, 42 {t}\n{t}x{i}  " for i, t in enumerate(segments.tokens[:32])
    )
    checks = (
        ("the probe conversation", text, token_ids(whole)),
        (
            "a text of special tokens",
            plain,
            list(tokenizer.encode(plain, add_special_tokens=False)),
        ),
    )
    for name, sample, want in checks:
        if segments.lookup(segments.split(sample)) != want:
            return f"{name} encodes differently by segments"
    return None


def matcher(tokens: Iterable[str]) -> re.Pattern[str]:
    """A regex of these texts, the longest where several start at one place (as tokenizers'
    matching of added tokens), as a trie: at each place one path is tried, not every text."""
    trie: dict[str, Any] = {}
    for token in tokens:
        node = trie
        for c in token:
            node = node.setdefault(c, {})
        node[""] = {}  # a text ends here

    def pattern(node: dict[str, Any]) -> str:
        paths = [re.escape(c) + pattern(child) for c, child in node.items() if c]
        if not paths:
            return ""
        body = paths[0] if len(paths) == 1 else "(?:" + "|".join(paths) + ")"
        return f"(?:{body})?" if "" in node else body  # greedy: the longer text first

    return re.compile(pattern(trie))


def token_ids(encoded: Any) -> list[int]:
    """apply_chat_template's ids as a list (transformers 5 may return a BatchEncoding); the
    preprocessor checks that they are ids (TypeError or KeyError where nothing is)."""
    if isinstance(encoded, Mapping) or hasattr(encoded, "input_ids"):
        encoded = encoded["input_ids"]
    return list(encoded)


def _first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _bounded(text: str) -> bool:
    return bool(text) and not any(
        c.isalnum() or c == "_" or c.isspace() for c in (text[0], text[-1])
    )
