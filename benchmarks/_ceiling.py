"""In-process ceiling: mlx_lm's own BatchGenerator on the same prompts, no HTTP.

Run as a child process (``python -m benchmarks._ceiling SPEC.json OUT.json``) so that it
gets the same BLAS preload as the servers and a clean process. The spec holds the model
path, the prompt texts per level and repeat, and the generation settings.

Per level the loop keeps ``concurrency`` sequences in flight: it inserts ``concurrency``
prompts, then inserts a new one each time one finishes. No stop tokens are set, so EOS is
ignored and every sequence runs to ``max_tokens``. TTFT is the time from ``insert`` to the
``next()`` call that returned the sequence's first token; every token is one "chunk".
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from benchmarks import _cpu
from benchmarks._nvml import BusyMeter
from benchmarks._stats import RequestRecord, summarize_level

REPO_ROOT = Path(__file__).resolve().parent.parent


def run_level(
    model: Any,
    prompts: list[list[int]],
    concurrency: int,
    max_tokens: int,
    level_timeout: float,
    prefill_step_size: int,
) -> tuple[list[RequestRecord], float]:
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(
        model,
        max_tokens=max_tokens,
        stop_tokens=None,
        completion_batch_size=concurrency,
        prefill_batch_size=concurrency,
        prefill_step_size=prefill_step_size,
    )
    pending = deque(prompts)
    records: dict[int, RequestRecord] = {}

    def insert(k: int) -> None:
        batch = [pending.popleft() for _ in range(k)]
        now = time.perf_counter()
        uids = gen.insert(batch, max_tokens=[max_tokens] * k)
        for uid, toks in zip(uids, batch, strict=True):
            records[uid] = RequestRecord(start=now, prompt_tokens=len(toks), completion_tokens=0)

    t0 = time.perf_counter()
    deadline = t0 + level_timeout
    insert(min(concurrency, len(pending)))
    active = len(records)
    # Bounded: each step yields at least one token per decoding sequence once prefilled.
    max_steps = (len(prompts) + 1) * (max_tokens + 64) + 10_000
    timed_out = False
    for _ in range(max_steps):
        if active == 0:
            break
        if time.perf_counter() > deadline:
            timed_out = True
            break
        _, responses = gen.next()
        now = time.perf_counter()
        finished = 0
        for r in responses:
            rec = records[r.uid]
            rec.chunk_times.append(now)
            rec.completion_tokens = (rec.completion_tokens or 0) + 1
            if r.finish_reason is not None:
                rec.end = now
                finished += 1
                if (rec.completion_tokens or 0) >= max_tokens:
                    rec.ok = True
                else:
                    rec.error = f"short: {rec.completion_tokens} ({r.finish_reason})"
        active -= finished
        if finished and pending:
            k = min(finished, len(pending))
            insert(k)
            active += k
    for rec in records.values():
        if not rec.end:
            rec.end = time.perf_counter()
            rec.error = "deadline: level deadline" if timed_out else "unfinished"
    wall = max(r.end for r in records.values()) - t0 if records else 0.0
    for _ in range(len(pending)):
        records[-1 - len(records)] = RequestRecord(start=t0, end=t0, error="not_started")
    gen.close()
    mx.clear_cache()
    return list(records.values()), wall


def run_inprocess(
    args: Any,
    model: str,
    bank: Any,
    env: dict[str, str],
    work: Path,
    repeat: int,
    levels: list[int],
) -> dict[str, Any]:
    """One repeat of `levels` in a child process: {"levels": [summary, ...]}."""
    spec = {
        "model": model,
        "max_tokens": args.max_tokens,
        "level_timeout": args.level_timeout,
        "warmup_prompt": bank.warmup,
        "max_steal": args.max_steal,
        "warm_levels": bool(getattr(args, "warm_levels", False)),
        # the first set, then fresh prompts for each measurement again under steal
        "levels": [
            {
                "concurrency": c,
                "prompts_per_attempt": [
                    bank.get(-1, c, repeat, attempt) for attempt in range(args.steal_retries + 1)
                ],
            }
            for c in levels
        ],
    }
    tag = f"{repeat}-{'-'.join(map(str, levels))}"
    spec_path = work / f"inprocess-spec-{tag}.json"
    out_path = work / f"inprocess-out-{tag}.json"
    spec_path.write_text(json.dumps(spec))
    budget = (args.level_timeout + 60) * len(levels) * (args.steal_retries + 1) + 300
    cmd = [sys.executable, "-m", "benchmarks._ceiling", str(spec_path), str(out_path)]
    print(f"[inprocess] {model} (LD_PRELOAD={env.get('LD_PRELOAD', '')})", file=sys.stderr)
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, timeout=budget, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"in-process run exceeded {budget:.0f}s", "levels": []}
    if proc.returncode != 0 or not out_path.exists():
        return {"error": f"in-process run failed with exit {proc.returncode}", "levels": []}
    data = json.loads(out_path.read_text())
    levels = [lv["runs"][0] for lv in data["levels"]]
    return {"levels": levels, "peak_memory_mb": data.get("peak_memory_mb")}


def main(spec_path: str, out_path: str) -> int:
    import mlx.core as mx
    from mlx_lm import load

    spec = json.loads(Path(spec_path).read_text())
    model, tokenizer = load(spec["model"])

    def encode(text: str) -> list[int]:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        return list(ids)

    max_tokens = int(spec["max_tokens"])
    step = int(spec.get("prefill_step_size", 2048))
    timeout = float(spec["level_timeout"])
    # Warm-up: one short sequence, as the HTTP targets get one warm-up request.
    run_level(model, [encode(spec["warmup_prompt"])], 1, 8, timeout, step)

    def measure(c: int, texts: list[str]) -> dict[str, Any]:
        prompts = [encode(t) for t in texts]
        cpu0, sys0 = time.process_time(), _cpu.snapshot()
        with BusyMeter() as gpu:  # NVML's busy share where there is an NVIDIA GPU
            records, wall = run_level(model, prompts, c, max_tokens, timeout, step)
        sys1 = _cpu.snapshot()
        system = _cpu.busy_pct(sys0, sys1)
        summary = summarize_level(records, wall, c, max_tokens)
        own = round(100 * (time.process_time() - cpu0) / wall, 1)
        summary.update(
            server_cpu_pct=own,
            system_cpu_pct=system,
            steal_pct=_cpu.steal_pct(sys0, sys1),
            gpu_busy_pct=gpu.share,
        )
        if system is not None:
            summary["other_cpu_pct"] = round(system - own, 1)
        print(
            f"[inprocess] c={c} tok/s={summary['output_tok_s']} "
            f"ttft_p50={summary['ttft_p50_ms']}ms itl_p50={summary['itl_p50_ms']}ms "
            f"steal={summary['steal_pct']}% gpu_busy={gpu.share}% "
            f"fail={summary['failures']}/{summary['requests']}",
            file=sys.stderr,
            flush=True,
        )
        return summary

    if spec.get("warm_levels"):  # each level once, unrecorded: shapes compiled first
        for level in spec["levels"]:
            c = int(level["concurrency"])
            prompts = [encode(t) for t in level["prompts_per_attempt"][0]]
            run_level(model, prompts[::-1], c, max_tokens, timeout, step)
            print(f"[inprocess] c={c} warmed", file=sys.stderr, flush=True)
    levels: list[dict[str, Any]] = []
    for level in spec["levels"]:
        c = int(level["concurrency"])
        attempts = level["prompts_per_attempt"]
        tried: list[dict[str, Any]] = []
        for attempt, texts in enumerate(attempts):
            tried.append(measure(c, texts))
            if attempt == len(attempts) - 1 or not _cpu.contended(tried[-1], spec["max_steal"]):
                break
            print(f"[inprocess] c={c}: steal over the limit, measured again", file=sys.stderr)
        levels.append({"concurrency": c, "runs": [_cpu.least_stolen(tried, spec["max_steal"])]})
    out = {
        "model": spec["model"],
        "levels": levels,
        "peak_memory_mb": round(mx.get_peak_memory() / 2**20, 1),
    }
    Path(out_path).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print("usage: python -m benchmarks._ceiling SPEC.json OUT.json", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
