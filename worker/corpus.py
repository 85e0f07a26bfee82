"""The text that generated models' tokenizers are trained on: deterministic English-ish prose
with digits, punctuation, code, spaces, tabs and newlines (and some non-ASCII on request)."""

from __future__ import annotations

import random
from collections.abc import Sequence

CORPUS_SEED = 20240611


_PROSE = """\
The gateway starts one worker per model and talks to it over a socket.
A request arrives, the prompt is tokenized, and tokens stream back as they are made.
On Monday, 3 June 2024 at 09:45, the queue held 17 requests (12 chat, 5 completions).
"Is it fast?" she asked. "Fast enough," he said; "about 42.5 tokens/s on 2 cores."
Prices: $3.99, 15% off, #7 in line, 2^10 = 1024, 7 * 6 = 42, 100 / 4 = 25, a & b | c.
Email: team@example.com; path: /var/cache/models/demo-llama; url: https://example.org/a?b=c
def add(a, b):
\treturn a + b

for i in range(10):
\tprint(f"{i:>3} -> {i * i}")
{"role": "user", "content": "Hello!"} [1, 2, 3] <tag attr='x'>text</tag> `code` ~home
Lists work too:
- first item
- second item, with a comma
1. numbered; 2. also numbered: 3. done!
"""

_UNICODE_PROSE = (
    "Caf\u00e9, na\u00efve, r\u00e9sum\u00e9, jalape\u00f1o, Z\u00fcrich, S\u00e3o Paulo.\n"
    "\u6771\u4eac, \u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac, "
    "\u0440\u0443\u0441\u0441\u043a\u0438\u0439 \u2014 \u201cquotes\u201d \u2026 "
    "\u20ac5 \U0001f642\n"
)

_WORD_TEXT = (
    "the of and to in is was for on that with as by at from it an be this are or have not but"
    " which one all were they we when there can more no if out so said what up its about into"
    " than them time only new some could these two may first then do any like my now over such"
    " our man even most made after also did many before must through back years where much your"
    " way well down should because each just those people how too little state good very make"
    " world still own see men work long get here between both life being under never day same"
    " another know while last might us great old year off come since against go came right used"
    " take three model token stream worker queue cache batch prompt reply server client request"
)
_ONSETS = ("", "b", "br", "c", "ch", "cl", "d", "dr", "f", "fl", "g", "gr", "h", "j", "k", "l")
_ONSETS2 = ("m", "n", "p", "pl", "qu", "r", "s", "sh", "sk", "st", "t", "th", "tr", "v", "w", "z")
_NUCLEI = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "oo", "y")
_CODAS = ("", "", "n", "r", "s", "t", "l", "nd", "ng", "st", "ck", "m", "x")
_ENDINGS = (".", ".", ".", "!", "?", ";", ":", ",", "...", ")")


def _pseudo_word(rng: random.Random) -> str:
    onsets = _ONSETS + _ONSETS2
    syllables = rng.randint(1, 3)
    return "".join(
        rng.choice(onsets) + rng.choice(_NUCLEI) + rng.choice(_CODAS) for _ in range(syllables)
    )


def _sentence(rng: random.Random, common: Sequence[str], rare: Sequence[str]) -> str:
    count = rng.randint(4, 14)
    words = [rng.choice(rare if rng.random() < 0.5 else common) for _ in range(count)]
    if rng.random() < 0.25:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
    if rng.random() < 0.1:
        words.insert(rng.randrange(len(words)), rng.choice(("(see", "[1]", '"so"', "-", "a/b")))
    words[0] = words[0].capitalize()
    if rng.random() < 0.05:
        words[-1] = words[-1].upper()
    prefix = "\t" if rng.random() < 0.08 else ""
    return prefix + " ".join(words) + rng.choice(_ENDINGS) + rng.choice((" ", " ", "\n", "\n\n"))


def builtin_corpus(min_chars: int = 8000, *, non_ascii: bool = False) -> str:
    """Deterministic English-ish text with digits, punctuation, spaces, tabs and newlines."""
    rng = random.Random(CORPUS_SEED)
    common = _WORD_TEXT.split()
    rare = [_pseudo_word(rng) for _ in range(max(200, min_chars // 40))]
    parts = [_PROSE, _UNICODE_PROSE if non_ascii else ""]
    size = sum(map(len, parts))
    while size < min_chars:
        parts.append(_sentence(rng, common, rare))
        size += len(parts[-1])
    return "".join(parts)
