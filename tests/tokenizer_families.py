"""Tokenizers built like the common model families' (Llama 3, Llama 2, Mistral, Qwen2,
Gemma), trained here on a small corpus: their pre-tokenizers, normalizers, byte fallback,
special and other added tokens, with their own chat templates, saved as a checkpoint has
them (tests/test_prompt_segments_families.py loads them as the worker does)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import PreTrainedTokenizerFast

from worker.corpus import builtin_corpus

# ---- the families' templates (as their checkpoints ship them) ------------------------------

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ ' '  + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)

# Mistral-7B-Instruct-v0.3's (its tokenizer has [INST] and [/INST] as control tokens),
# without its tool calls: the system message goes before the last user message.
MISTRAL_TEMPLATE = """\
{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
    {%- if (message["role"] == "user") != (loop.index0 % 2 == 0) %}
        {{- raise_exception("After the optional system message, conversation roles must \
alternate user/assistant/user/assistant/...") }}
    {%- endif %}
{%- endfor %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the \
exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

QWEN2_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)

# ---- the families' tokenizers ----------------------------------------------------------------

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPECIAL = (
    *("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>"),
    *("<|reserved_special_token_1|>", "<|start_header_id|>", "<|end_header_id|>"),
    *("<|reserved_special_token_2|>", "<|eot_id|>"),
)
SP_SPECIAL = ("<unk>", "<s>", "</s>")
INST = ("[INST]", "[/INST]")
QWEN2_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN2_MARKERS = ("<tool_call>", "</tool_call>", "<|fim_prefix|>")  # added, not special
GEMMA_SPECIAL = (
    *("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "[@BOS@]", "<2mass>"),
    *("<start_of_turn>", "<end_of_turn>"),
)
GEMMA_SYMBOLS = ("\n\n", "\t\t", "<table>", "</table>")  # SentencePiece's user symbols

VOCAB_SIZE = 700
# The corpus: prose, code, digits, unicode (some of it decomposed), whitespace runs.
EXTRA_TEXT = (
    "def f(x):\n    return x  *  2\n\n\n\tindented\t\ttabs   and    spaces\n"
    "Cafe\u0301 vs Caf\u00e9, 日本語のテキスト, Ελληνικά, emoji 🙂🙂 — 1234567 + 89 = 1234656\n"
)


def corpus() -> str:
    return builtin_corpus(6000, non_ascii=True) + EXTRA_TEXT * 5


def byte_level(split: str, special: tuple[str, ...], nfc: bool) -> Tokenizer:
    """A byte-level BPE behind a split regex (Llama 3's, Qwen2's), trained here."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC() if nfc else None
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([corpus()], trainer)
    return tokenizer


def sentencepiece_like(special: tuple[str, ...]) -> Tokenizer:
    """A BPE over "▁"-marked words with byte fallback (<0x00>..<0xFF> in the vocabulary, not
    added tokens), as SentencePiece models converted to tokenizers are; trained here. The
    caller sets the pipeline its family's tokenizer.json has."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace("▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=list(special), show_progress=False
    )
    tokenizer.train_from_iterator(corpus().splitlines(keepends=True), trainer)
    data = json.loads(tokenizer.to_str())
    vocab = data["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tokenizer = Tokenizer.from_str(json.dumps(data))
    strip = [decoders.Strip(" ", 1, 0)] if special[0] == "<unk>" else []  # Llama's: the prefix
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    return tokenizer


def with_bos(tokenizer: Tokenizer, bos: str) -> Tokenizer:
    """The post-processor that adds BOS (the template writes it itself: never used here)."""
    bos_id = tokenizer.token_to_id(bos)
    template = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
    )
    tokenizer.post_processor = template
    return tokenizer


def llama3() -> Tokenizer:
    tokenizer = with_bos(byte_level(LLAMA3_SPLIT, LLAMA3_SPECIAL, nfc=False), LLAMA3_SPECIAL[0])
    tokenizer.post_processor = processors.Sequence(
        [processors.ByteLevel(trim_offsets=False), tokenizer.post_processor]
    )
    return tokenizer


def llama2() -> Tokenizer:
    """Llama 2's file (the older conversion): "▁" prepended and spaces replaced by the
    normalizer, no pre-tokenizer. [INST] and [/INST] are text to it (and to Mistral v0.1)."""
    tokenizer = with_bos(sentencepiece_like(SP_SPECIAL), "<s>")
    tokenizer.pre_tokenizer = None
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    return tokenizer


def mistral() -> Tokenizer:
    """Mistral v0.3's file: Metaspace, "▁" before the first piece only; [INST] and [/INST]
    are control (special) tokens."""
    tokenizer = with_bos(sentencepiece_like((*SP_SPECIAL, *INST)), "<s>")
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace("▁", prepend_scheme="first", split=False)
    return tokenizer


def qwen2() -> Tokenizer:
    tokenizer = byte_level(QWEN2_SPLIT, QWEN2_SPECIAL, nfc=True)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN2_MARKERS])
    return tokenizer


def gemma() -> Tokenizer:
    """Gemma's file: spaces replaced by the normalizer, no pre-tokenizer, no prefix."""
    tokenizer = with_bos(sentencepiece_like(GEMMA_SPECIAL), "<bos>")
    tokenizer.pre_tokenizer = None
    tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in GEMMA_SYMBOLS])
    return tokenizer


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    build: Callable[[], Tokenizer]
    template: str
    tokenizer_class: str  # as the family's tokenizer_config.json names it
    config: dict[str, Any]
    pipeline: dict[str, str]  # the loaded backend's parts, by type
    written: dict[str, str]  # the same, as its tokenizer.json has them
    special: tuple[str, ...]  # its special tokens
    markers: tuple[str, ...] = ()  # its added tokens that are not special
    text: tuple[str, ...] = ()  # its template's markers that are plain text to it
    system: bool = True  # whether its template takes a system message
    byte_fallback: bool = True  # else byte-level
    new_segments: int = 2  # at most, on the next turn of a conversation
    reused_from: int = 1  # the first turn that finds segments of an earlier one

    @property
    def literal(self) -> tuple[str, ...]:
        """Token texts that messages carry literally (a client may send them)."""
        return self.special + self.markers + self.text


BYTE_LEVEL = {"pre_tokenizer": "Sequence", "model": "BPE"}
METASPACE = {"pre_tokenizer": "Metaspace", "normalizer": "NoneType", "model": "BPE"}
NORMALIZED = {"pre_tokenizer": "NoneType", "model": "BPE"}
# LlamaTokenizer with legacy (Llama 2's configs): "▁" before every piece between added
# tokens; without, before the first only
FAMILIES = (
    Family(
        "llama3",
        llama3,
        LLAMA3_TEMPLATE,
        "PreTrainedTokenizerFast",
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        BYTE_LEVEL | {"normalizer": "NoneType"},
        BYTE_LEVEL | {"normalizer": "NoneType"},
        LLAMA3_SPECIAL,
        byte_fallback=False,
    ),
    Family(
        "llama2",
        llama2,
        LLAMA2_TEMPLATE,
        "LlamaTokenizer",
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "legacy": True},
        METASPACE | {"prepend_scheme": "always"},
        NORMALIZED | {"normalizer": "Sequence"},
        SP_SPECIAL,
        text=(*INST, "<<SYS>>", "<</SYS>>"),
        reused_from=2,  # the first segment grows by the first answer
    ),
    Family(
        "mistral",
        mistral,
        MISTRAL_TEMPLATE,
        "LlamaTokenizer",
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "legacy": False},
        METASPACE | {"prepend_scheme": "first"},
        METASPACE | {"prepend_scheme": "first"},
        (*SP_SPECIAL, *INST),
        new_segments=3,  # the system message moves to the last user message
    ),
    Family(
        "qwen2",
        qwen2,
        QWEN2_TEMPLATE,
        "Qwen2Tokenizer",
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None},
        BYTE_LEVEL | {"normalizer": "NFC"},
        BYTE_LEVEL | {"normalizer": "NFC"},
        QWEN2_SPECIAL,
        markers=QWEN2_MARKERS,
        byte_fallback=False,
    ),
    Family(
        "gemma",
        gemma,
        GEMMA_TEMPLATE,
        "GemmaTokenizer",
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"},
        {"pre_tokenizer": "Split", "normalizer": "Replace", "model": "BPE"},
        NORMALIZED | {"normalizer": "Replace"},
        GEMMA_SPECIAL,
        markers=GEMMA_SYMBOLS,
        system=False,
    ),
)


def saved(family: Family, path: Path) -> Path:
    """The family's tokenizer files, as a checkpoint has them."""
    fast = PreTrainedTokenizerFast(
        tokenizer_object=family.build(), chat_template=family.template, **family.config
    )
    fast.save_pretrained(path)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = family.tokenizer_class
    config_path.write_text(json.dumps(config))
    return path


def as_written(family: Family) -> Family:
    """The family loaded as PreTrainedTokenizerFast: its tokenizer.json's pipeline kept (as
    transformers 4 kept it for every family, and 5 does for a checkpoint that names it)."""
    return replace(
        family,
        name=f"{family.name}-as-written",
        tokenizer_class="PreTrainedTokenizerFast",
        pipeline=family.written,
    )


LOADS = (*FAMILIES, *(as_written(f) for f in FAMILIES if f.pipeline != f.written))
