"""What a JSON-schema token constraint costs the host CPU, per library, on one vocabulary.

    python -m benchmarks.constraints --vocab 128000 --steps 200 --batch 32 --json /tmp/c.json

Libraries that import are measured, the rest skipped with a note. All fill one numpy int32
bitmask (batch, ceil(V/32)) that `mx.array` and plain mx ops apply on any MLX backend; the
mask is computed on the host CPU on every backend. Per schema: compile, mask and advance times
along a valid instance, batch steps; per feature: enforced / ignored / rejects valid / error,
and documents sampled under the mask checked with jsonschema. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._vocab import EOS_ID, load_tokenizer, one_byte_tokens, token_bytes

try:
    from jsonschema import Draft202012Validator as Validator
except ImportError:  # documents sampled under a mask are then parsed but not validated
    Validator = None

S, INT, NUM, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def _obj(extra: dict[str, Any] | None = None, **props: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props), **(extra or {})}


CLOSED, NULL = {"additionalProperties": False}, {"type": "null"}
# fmt: off
_NODE = _obj(CLOSED, label=S, children={"type": "array", "items": {"$ref": "#/$defs/node"}})
_TREE = {"$ref": "#/$defs/t",
         "$defs": {"t": _obj(v=INT, kids={"type": "array", "items": {"$ref": "#/$defs/t"}})}}
_ITEM = _obj(sku=S, quantity=INT, price=NUM, kind={"enum": ["book", "tool", "food"]})
# name: (schema, a valid instance)
SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "flat": (_obj(name=S, age=INT, email=S, active=B, score=NUM),
             {"name": "Ada Lovelace, who wrote the first program for the Analytical Engine",
              "age": 36, "email": "ada@example.org", "active": True, "score": 97.25}),
    "nested": (_obj(order_id=S, status={"enum": ["pending", "shipped", "delivered"]},
                    customer=_obj(name=S, tier={"enum": ["free", "pro"]},
                                  tags={"type": "array", "items": S}),
                    items={"type": "array", "items": _ITEM}),
               {"order_id": "ORD-2024-0613", "status": "shipped",
                "customer": {"name": "Grace Hopper", "tier": "pro", "tags": ["navy", "vip"]},
                "items": [{"sku": f"SKU-{i:04d}", "quantity": i + 1, "price": 9.99 + 3 * i,
                           "kind": ("book", "tool", "food")[i % 3]} for i in range(6)]}),
    "tool_call": (_obj(name={"const": "get_weather"}, arguments=_obj(
                      location=S, unit={"enum": ["celsius", "fahrenheit"]}, days=INT, hourly=B)),
                  {"name": "get_weather", "arguments": {"location": "Zurich, Switzerland",
                                                        "unit": "celsius", "days": 3,
                                                        "hourly": False}}),
    "json_object": ({"type": "object"},
                    {"query": "weather in Paris", "ok": True, "results": [
                        {"day": 1, "temp": 18.5, "rain": None}, {"day": 2, "rain": "light"}]}),
    "kitchen_sink": (
        _obj({**CLOSED, "$defs": {"node": _NODE}},
             id={"type": "string", "pattern": "^[a-z]{2}-[0-9]{4}$"},
             created={"type": "string", "format": "date-time"},
             title={"type": "string", "minLength": 3, "maxLength": 40},
             contact={"oneOf": [_obj(CLOSED, email=S),
                                _obj(CLOSED, phone={"type": "string", "pattern": "^[0-9]{7}$"})]},
             note={"anyOf": [S, NULL]}, tags={"type": "array", "items": S, "maxItems": 3},
             tree={"$ref": "#/$defs/node"}),
        {"id": "ab-1234", "created": "2024-06-03T09:45:00Z", "title": "Quarterly report",
         "contact": {"email": "team@example.com"}, "note": None, "tags": ["q2", "finance"],
         "tree": {"label": "root", "children": [{"label": "a", "children": []}]}}),
}
# name: (schema, a valid instance, an instance that breaks only this feature)
FEATURES: dict[str, tuple[dict[str, Any], Any, Any]] = {
    "pattern": (_obj(code={"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}),
                {"code": "ABC-123"}, {"code": "abc-123"}),
    "format date-time": (_obj(at={"type": "string", "format": "date-time"}),
                         {"at": "2024-06-03T09:45:00Z"}, {"at": "next monday"}),
    "minLength/maxLength": (_obj(s={"type": "string", "minLength": 5, "maxLength": 8}),
                            {"s": "hello"}, {"s": "hi"}),
    "oneOf (disjoint)": (_obj(v={"oneOf": [INT, S]}), {"v": 5}, {"v": True}),
    "oneOf (overlapping)": (_obj(v={"oneOf": [_obj(a=INT), _obj(b=INT)]}),
                            {"v": {"a": 1}}, {"v": {"a": 1, "b": 2}}),
    "anyOf": (_obj(v={"anyOf": [B, NULL]}), {"v": None}, {"v": 3}),
    "$ref/$defs": ({**_obj(p={"$ref": "#/$defs/pt"}), "$defs": {"pt": _obj(x=INT)}},
                   {"p": {"x": 1}}, {"p": {"x": "1"}}),
    "additionalProperties false": (_obj(CLOSED, a=INT), {"a": 1}, {"a": 1, "b": 2}),
    "open object (default)": (_obj(a=INT), {"a": 1, "b": 2}, {"a": "1", "b": 2}),  # a's type
    "minItems/maxItems": (_obj(xs={"type": "array", "items": INT, "minItems": 2, "maxItems": 3}),
                          {"xs": [1, 2]}, {"xs": [1, 2, 3, 4]}),
    "recursive $ref (depth 5)": (_TREE, {"v": 5, "kids": [{"v": 4, "kids": [{"v": 3, "kids": [
                                     {"v": 2, "kids": [{"v": 1, "kids": []}]}]}]}]},
                                 {"v": 1, "kids": [{"v": "x", "kids": []}]}),
}
# fmt: on


@dataclass(slots=True)
class Library:
    """A constraint library behind the calls the worker would make; compile raises if refused."""

    vocab: int
    compile: Callable[[dict[str, Any]], Any]  # schema -> the grammar an application caches
    matcher: Callable[[Any], Any]  # compiled grammar -> a fresh matcher
    fill: Callable[[Any, np.ndarray, int], Any]  # write the matcher's mask into mask[row]
    consume: Callable[[Any, int], bool]
    step_par: Callable[[list[Any], np.ndarray, list[int]], Any] | None = None  # masks + tokens


def _llguidance(tokenizer_json: str, vocab: int) -> Library:
    import llguidance as ll
    import llguidance.numpy as lnp

    tokenizer = ll.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=EOS_ID)
    executor = ll.LLExecutor(num_threads=os.cpu_count() or 1)

    def compile(schema: dict[str, Any]) -> Any:
        matcher = ll.LLMatcher(
            tokenizer, ll.LLMatcher.grammar_from_json_schema(schema), log_level=0
        )
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher  # never advanced: each request starts from a copy

    def step_par(ms: list[Any], mask: np.ndarray, tokens: list[int]) -> None:
        lnp.fill_next_token_bitmask_par(executor, [*zip(ms, range(len(ms)), strict=True)], mask)
        executor.consume_token_par([*zip(ms, tokens, strict=True)])

    fill, consume = lnp.fill_next_token_bitmask, lambda m, t: m.consume_token(t)
    return Library(vocab, compile, lambda c: c.deep_copy(), fill, consume, step_par)


def _xgrammar(tokenizer: str, vocab: int, dynamic: bool = False, strict: bool = False) -> Library:
    import xgrammar as xg
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer))
    info = xg.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[EOS_ID])
    threads = os.cpu_count() or 1
    compiler = xg.GrammarCompiler(info, max_threads=threads, enable_dynamic_compilation=dynamic)
    batch = xg.BatchGrammarMatcher(max_threads=threads)

    def compile(schema: dict[str, Any]) -> Any:
        compiler.clear_cache()  # strict_mode (xgrammar's default) closes every object
        return compiler.compile_json_schema(json.dumps(schema), strict_mode=strict)

    def step_par(ms: list[Any], mask: np.ndarray, tokens: list[int]) -> None:
        batch.batch_fill_next_token_bitmask(ms, mask)
        xg.BatchGrammarMatcher.batch_accept_token(ms, tokens)

    m = xg.GrammarMatcher  # its fill takes a numpy array through DLPack: no torch tensor
    return Library(vocab, compile, m, m.fill_next_token_bitmask, m.accept_token, step_par)


def _outlines_core(tokenizer_json: str, vocab: int) -> Library:
    import outlines_core as oc
    from outlines_core.json_schema import build_regex_from_schema

    vocabulary = oc.Vocabulary(EOS_ID, {raw: [i] for i, raw in token_bytes(tokenizer_json).items()})

    def fill(m: Any, mask: np.ndarray, row: int) -> None:
        m.write_mask_into(mask[row].ctypes.data, mask.shape[1], 4)

    def consume(m: Any, token: int) -> bool:
        if token == EOS_ID:  # allowed in a final state, but not a transition of the index
            return bool(m.is_finished())
        try:
            m.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def compile(schema: dict[str, Any]) -> Any:
        return oc.Index(build_regex_from_schema(json.dumps(schema)), vocabulary)

    return Library(vocab, compile, oc.Guide, fill, consume)


LIBRARIES: dict[str, Callable[[str, int], Library]] = {
    "llguidance": _llguidance,
    "xgrammar": _xgrammar,
    "xgrammar-dynamic": partial(_xgrammar, dynamic=True),
    "xgrammar-strict": partial(_xgrammar, strict=True),
    "outlines-core": _outlines_core,
}


def load(names: list[str], tokenizer_json: str, vocab: int) -> tuple[dict[str, Library], dict]:
    """The libraries that import, and each one's version and setup ms or why it was skipped."""
    loaded, info = {}, {}
    for name in names:
        try:
            start = time.perf_counter()
            loaded[name] = LIBRARIES[name](tokenizer_json, vocab)
            setup_ms = 1000 * (time.perf_counter() - start)
            dist = "xgrammar" if name.startswith("xgrammar") else name
            info[name] = {"version": version(dist), "setup_ms": setup_ms}
        except ImportError as exc:
            info[name] = {"skipped": f"{type(exc).__name__}: {exc}"}
    return loaded, info


def _mask(rows: int, vocab: int) -> np.ndarray:
    return np.full((rows, (vocab + 31) // 32), -1, dtype=np.int32)


def _ms(values: list[float], q: float = 0.5) -> float:
    return 1000 * float(np.quantile(values, q))


def _walk(lib: Library, compiled: Any, tokens: list[int]) -> list[tuple[float, float]] | None:
    """A fresh matcher along `tokens`: (mask s, advance s) per token; None if it stopped."""
    m, mask, times = lib.matcher(compiled), _mask(1, lib.vocab), []
    for token in tokens:
        t0 = time.perf_counter()
        lib.fill(m, mask, 0)
        t1 = time.perf_counter()
        if not (int(mask[0, token >> 5]) >> (token & 31)) & 1 or not lib.consume(m, token):
            return None
        times.append((t1 - t0, time.perf_counter() - t1))
    return times


def _batch(lib: Library, compiled: Any, tokens: list[int], batch: int, steps: int) -> dict:
    """Median ms of one step of `batch` matchers, each at another point of the document."""
    out, mask = {}, _mask(batch, lib.vocab)
    for mode in ("seq", "par") if lib.step_par else ("seq",):
        ms, times = [lib.matcher(compiled) for _ in range(batch)], []
        pos = [(i * 7) % len(tokens) for i in range(batch)]
        for m, p in zip(ms, pos, strict=True):
            for token in tokens[:p]:
                lib.consume(m, token)
        for _ in range(steps):
            step = [tokens[p] for p in pos]
            t0 = time.perf_counter()
            if mode == "par" and lib.step_par:
                lib.step_par(ms, mask, step)
            else:
                for row, (m, token) in enumerate(zip(ms, step, strict=True)):
                    lib.fill(m, mask, row)
                    lib.consume(m, token)
            times.append(time.perf_counter() - t0)
            pos = [(p + 1) % len(tokens) for p in pos]
            ms = [m if p else lib.matcher(compiled) for m, p in zip(ms, pos, strict=True)]
        out[f"batch_{mode}_ms"] = _ms(times)
    return out


def measure(lib: Library, schema: dict, tokens: list[int], steps: int, batch: int) -> dict:
    t0 = time.perf_counter()
    try:
        lib.matcher(compiled := lib.compile(schema))
    except Exception as exc:
        return {"error": " ".join(f"{type(exc).__name__}: {exc}".split())[:160]}
    t1 = time.perf_counter()
    lib.matcher(compiled)
    row = {"compile_ms": 1000 * (t1 - t0), "warm_ms": 1000 * (time.perf_counter() - t1)}
    walks: list[list[tuple[float, float]]] = []
    while sum(map(len, walks)) < steps:
        if (walk := _walk(lib, compiled, tokens)) is None:
            return {**row, "error": "stopped the valid instance"}
        walks.append(walk)
    masks, advances = [t[0] for w in walks for t in w], [t[1] for w in walks for t in w]
    row |= {"first_mask_ms": _ms([w[0][0] for w in walks]), "mask_p50_ms": _ms(masks)}
    row |= {"mask_p90_ms": _ms(masks, 0.9), "advance_p50_ms": _ms(advances), "tokens": len(tokens)}
    return row | _batch(lib, compiled, tokens, batch, max(1, steps // 4))


def _sample(lib: Library, compiled: Any, rng: random.Random, short: list, decode: Callable) -> Any:
    """A document sampled under the mask: EOS once allowed, else mostly one-byte tokens."""
    m, mask, ids = lib.matcher(compiled), _mask(1, lib.vocab), []
    for _ in range(400):  # tokens at most, else "unfinished"
        lib.fill(m, mask, 0)
        bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[: lib.vocab]
        if bits[EOS_ID]:
            try:
                return json.loads(decode(ids))
            except ValueError:
                return "not JSON"
        few = [t for t in short if bits[t]] if rng.random() < 0.95 else []
        ids.append(rng.choice(few) if few else int(rng.choice(np.flatnonzero(bits))))
        if not lib.consume(m, ids[-1]):
            return "stopped"
    return "unfinished"


def check_feature(lib: Library, feature: tuple, encode: Callable, sample: Callable) -> dict:
    schema, good, bad = feature
    try:
        compiled = lib.compile(schema)
    except Exception as exc:
        return {"status": "error", "detail": " ".join(f"{type(exc).__name__}: {exc}".split())[:160]}
    status = "rejects valid" if _walk(lib, compiled, encode(good)) is None else "ignored"
    if status == "ignored" and _walk(lib, compiled, encode(bad)) is None:
        status = "enforced"
    return {"status": status, "samples": sample(lib, compiled, schema)}


def run(tokenizer_json: str, names: list[str], steps: int, batch: int, samples: int) -> dict:
    """The whole measurement, as the JSON that --json writes."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    vocab = tokenizer.get_vocab_size()

    def encode(value: Any) -> list[int]:
        text = json.dumps(value, separators=(",", ":"))
        return [*tokenizer.encode(text, add_special_tokens=False).ids, EOS_ID]

    short = one_byte_tokens(tokenizer_json)

    def sample(lib: Library, compiled: Any, schema: dict) -> dict[str, int]:
        rng = random.Random(0)
        docs = [_sample(lib, compiled, rng, short, tokenizer.decode) for _ in range(samples)]
        return Counter(d if isinstance(d, str) else _validate(schema, d) for d in docs)

    libs, info = load(names, tokenizer_json, vocab)
    machine = {"cpus": os.cpu_count(), "arch": platform.machine(), "system": platform.system()}
    result: dict[str, Any] = {"machine": machine, "vocab": vocab, "steps": steps, "batch": batch}
    result |= {"libraries": info, "schemas": {}, "features": {}}
    for name, (schema, instance) in SCHEMAS.items():
        tokens = encode(instance)
        per_lib = {n: measure(lib, schema, tokens, steps, batch) for n, lib in libs.items()}
        result["schemas"][name] = per_lib
    for name, feature in FEATURES.items():
        per_lib = {n: check_feature(lib, feature, encode, sample) for n, lib in libs.items()}
        result["features"][name] = per_lib
    return result


def _validate(schema: dict[str, Any], doc: Any) -> str:
    if Validator is None:
        return "unchecked"
    checker = Validator.FORMAT_CHECKER  # date-time only with rfc3339-validator installed
    return "valid" if Validator(schema, format_checker=checker).is_valid(doc) else "invalid"


def format_tables(result: dict[str, Any]) -> str:
    cols = ["compile", "warm", "first_mask", "mask_p50", "mask_p90", "advance_p50"]
    cols += ["batch_seq", "batch_par"]  # batch: result["batch"] matchers
    lines = [f"vocab {result['vocab']}, {result['machine']['cpus']} CPUs, batch {result['batch']}"]
    lines += ["| schema | library | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 2)]
    for schema, per_lib in result["schemas"].items():
        for lib, row in per_lib.items():
            cells = [f"{row[c + '_ms']:.3f}" if c + "_ms" in row else "-" for c in cols]
            lines.append(f"| {schema} | {lib} | " + (row.get("error") or " | ".join(cells)) + " |")
    libs = [n for n, i in result["libraries"].items() if "skipped" not in i]
    lines += ["", "| feature | " + " | ".join(libs) + " |", "|---|" + "---|" * len(libs)]
    for feature, per_lib in result["features"].items():
        cells = [f"{r['status']} {r.get('detail') or dict(r['samples'])}" for r in per_lib.values()]
        lines.append(f"| {feature} | " + " | ".join(cells) + " |")
    lines += [f"{name}: {lib_info}" for name, lib_info in result["libraries"].items()]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.constraints", description=__doc__)
    p.add_argument("--vocab", type=int, default=128000, help="size of the BPE vocab trained")
    p.add_argument("--tokenizer", help="a byte-level tokenizer.json (or its model dir) with EOS 0")
    p.add_argument("--libraries", default=",".join(LIBRARIES), help="comma-separated")
    p.add_argument("--steps", type=int, default=200, help="masks timed per schema at batch 1")
    p.add_argument("--batch", type=int, default=32, help="concurrent matchers")
    p.add_argument("--samples", type=int, default=3, help="sampled documents per feature")
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    args = p.parse_args(argv)
    args.libraries = [n.strip() for n in args.libraries.split(",") if n.strip()]
    if unknown := set(args.libraries) - set(LIBRARIES):
        p.error(f"unknown libraries: {sorted(unknown)}; known: {', '.join(LIBRARIES)}")
    if min(args.vocab, args.steps, args.batch) < 1 or args.samples < 0:
        p.error("--vocab, --steps and --batch must be at least 1, --samples at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokenizer_json = load_tokenizer(args.tokenizer, args.vocab)
    result = run(tokenizer_json, args.libraries, args.steps, args.batch, args.samples)
    print(format_tables(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
