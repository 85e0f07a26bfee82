"""Serving benchmark: streaming chat completions at fixed concurrency, against a ceiling.

Measures OpenAI-compatible servers (already running with ``--target NAME=URL``, or started
here with ``--launch`` / ``--launch-cmd``) and, with ``--inprocess``, mlx_lm's own
``BatchGenerator`` in a child process on the same model, prompts and lengths. For every
concurrency level it reports output tokens/s, TTFT and inter-token latency percentiles and
failures, as a Markdown table per model on stdout and as JSON (``--out``).

Run from the repository root, e.g.::

    python -m benchmarks.serving --model /tmp/bench-llama --inprocess \\
        --launch mlx_lm,vllm_mlx --vllm-mlx-cmd /tmp/vllm-venv/bin/vllm-mlx \\
        --concurrency 1,4,16,64 --out /tmp/bench.json

    python -m benchmarks.serving --target gateway=http://127.0.0.1:8000 \\
        --tokenizer /path/to/model --concurrency 1,4

All traffic goes to 127.0.0.1; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import _ceiling, _client, _cpu, _launch, _prompts
from benchmarks._nvml import BusyMeter
from benchmarks._serving_args import extra_body, pairs, parse_args
from benchmarks._stats import (
    machine_header,
    machine_info,
    markdown_table,
    merge_repeats,
    record_to_dict,
    summarize_level,
    table_rows,
)


@dataclass
class Job:
    """One thing to measure: a running URL, or a command to launch, for one model group."""

    name: str
    url: str | None = None
    command: str | None = None
    served_model: str | None = None


# --- HTTP targets --------------------------------------------------------------------------


async def measure_url(
    args: argparse.Namespace,
    job: Job,
    job_index: int,
    bank: _prompts.PromptBank,
    url: str,
    server: _launch.Server | None,
    repeat: int,
    levels: list[int],
) -> dict[str, Any]:
    """One repeat of `levels` against one URL: {"levels": [summary, ...], ...}."""
    client = _client.make_client(max(args.levels), args.request_timeout)
    async with client:
        model_id = await _client.served_model(client, url, job.served_model)
        warm = await _client.warm_up(client, url, model_id, bank.warmup, 16)
        result: dict[str, Any] = {
            "url": url,
            "model_id": model_id,
            "warmup": {"ok": warm.ok, "error": warm.error, "ttft_s": warm.ttft},
            "levels": [],
        }
        if warm.error and not warm.error.startswith("short"):
            print(f"[{job.name}] warm-up failed: {warm.error}", file=sys.stderr)
            result["error"] = f"warm-up failed: {warm.error}"
            return result

        async def load(c: int, prompts: list[str]) -> tuple[list[Any], float]:
            return await _client.run_level(
                client,
                url,
                model_id,
                prompts,
                c,
                args.max_tokens,
                not args.no_ignore_eos,
                args.level_timeout,
                extra_body(args, job.name),
            )

        async def measure(c: int, prompts: list[str]) -> dict[str, Any]:
            cpu0, scpu0 = time.process_time(), server.cpu_seconds() if server else None
            sys0 = _cpu.snapshot()
            share0 = await _client.gateway_account(client, url)
            opened = time.time()
            with BusyMeter() as gpu:  # NVML's busy share where there is an NVIDIA GPU
                records, wall = await load(c, prompts)
            closed = time.time()
            share1 = await _client.gateway_account(client, url)
            sys1 = _cpu.snapshot()
            system = _cpu.busy_pct(sys0, sys1)
            summary = summarize_level(records, wall, c, args.max_tokens)
            client_pct = round(100 * (time.process_time() - cpu0) / wall, 1)
            summary.update(
                client_cpu_pct=client_pct,
                system_cpu_pct=system,
                steal_pct=_cpu.steal_pct(sys0, sys1),
                window=[round(opened, 6), round(closed, 6)],  # benchmarks.step_trace's
                gpu_busy_pct=gpu.share,
            )
            if server and scpu0 is not None:
                scpu1 = server.cpu_seconds()
                if scpu1 is not None:
                    server_pct = round(100 * (scpu1 - scpu0) / wall, 1)
                    summary["server_cpu_pct"] = server_pct
                    if system is not None:
                        # CPU used by neither this client nor the server: other processes.
                        summary["other_cpu_pct"] = round(system - client_pct - server_pct, 1)
                summary["server_rss_mb"] = server.rss_mb()
            # the gateway's account: first tokens' preparing, queue and prefill in the worker,
            # its TTFT/ITL
            summary.update(_client.gateway_means(share0, share1))
            if args.raw:
                summary["raw"] = [record_to_dict(x) for x in records]
            share = "".join(
                f" {k.removesuffix('_mean_ms')}_mean={summary[k]}ms"
                for k in (
                    "preprocess_mean_ms",
                    "queue_mean_ms",
                    "prefill_mean_ms",
                    "gateway_itl_mean_ms",
                )
                if k in summary
            )
            print(
                f"[{job.name}] c={c} rep={repeat} tok/s={summary['output_tok_s']} "
                f"ttft_p50={summary['ttft_p50_ms']}ms itl_p50={summary['itl_p50_ms']}ms "
                f"itl_mean={summary['itl_mean_ms']}ms{share} "
                f"steal={summary['steal_pct']}% gpu_busy={gpu.share}% "
                f"fail={summary['failures']}/{summary['requests']} {summary['errors']}",
                file=sys.stderr,
                flush=True,
            )
            return summary

        if args.warm_levels:
            for c in levels:
                await load(c, bank.get(job_index, c, repeat, WARM_ATTEMPT))
                print(f"[{job.name}] c={c} warmed", file=sys.stderr, flush=True)
        for c in levels:
            tried: list[dict[str, Any]] = []
            for attempt in range(args.steal_retries + 1):
                tried.append(await measure(c, bank.get(job_index, c, repeat, attempt)))
                if (
                    attempt == args.steal_retries
                    or not _cpu.contended(tried[-1], args.max_steal)
                    or (server and server.proc.poll() is not None)
                ):
                    break
                print(f"[{job.name}] c={c}: steal over the limit, measured again", file=sys.stderr)
            result["levels"].append(_cpu.least_stolen(tried, args.max_steal))
            if server and server.proc.poll() is not None:
                result["server_exit"] = server.proc.returncode
                print(f"[{job.name}] server exited ({server.proc.returncode})", file=sys.stderr)
                break
    return result


CLIENT_NICE = [0]  # set from --client-nice in main()
WARM_ATTEMPT = 999  # prompt-bank attempt number of --warm-levels runs (fresh prompts)


def _run_async(coro: Any) -> Any:
    """Run the load generator on its own thread at a lower priority (Linux nice is per
    thread): on a small machine it then takes only CPU the server leaves idle, as a client on
    another host would. Servers are launched from the main thread and keep normal priority."""
    box: dict[str, Any] = {}

    def target() -> None:
        if CLIENT_NICE[0] and hasattr(os, "setpriority"):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), CLIENT_NICE[0])
        try:
            import uvloop

            box["result"] = uvloop.run(coro)
        except ImportError:
            box["result"] = asyncio.run(coro)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, name="load-generator")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box.get("result")


def run_job(
    args: argparse.Namespace,
    job: Job,
    job_index: int,
    bank: _prompts.PromptBank,
    model: str | None,
    env: dict[str, str],
    log_dir: Path,
    repeat: int,
    levels: list[int],
) -> dict[str, Any]:
    if job.url:
        return _run_async(measure_url(args, job, job_index, bank, job.url, None, repeat, levels))
    assert job.command is not None and model is not None
    fields = {
        "model": model,
        "max_concurrency": str(max(max(args.levels), 32)),
        "python": sys.executable,
        "vllm_mlx_cmd": args.vllm_mlx_cmd or "vllm-mlx",
    }
    scratch = None
    if job.name in _launch.PRIVATE_HOME:
        # vllm-mlx persists its prefix cache under ~/.cache (GBs over a few runs): keep it
        # in a scratch HOME that is removed afterwards.
        scratch = Path(tempfile.mkdtemp(prefix=f"{job.name}-home-", dir=log_dir))
        env = {**env, "HOME": str(scratch)}
    try:
        server = _launch.Server(job.name, job.command, fields, env, log_dir)
    except (OSError, KeyError, ValueError) as e:
        print(f"[{job.name}] cannot launch: {e!r}", file=sys.stderr)
        return {"error": f"cannot launch {job.command!r}: {e!r}", "levels": []}
    print(f"[{job.name}] launching: {server.command}", file=sys.stderr, flush=True)
    try:
        server.wait_ready(args.ready_timeout)
        print(f"[{job.name}] ready in {server.ready_s:.1f}s", file=sys.stderr, flush=True)
        coro = measure_url(args, job, job_index, bank, server.url, server, repeat, levels)
        result = _run_async(coro)
        result["ready_s"] = round(server.ready_s or 0.0, 2)
    except RuntimeError as e:
        result = {"error": str(e), "levels": []}
        print(f"[{job.name}] {e}", file=sys.stderr)
    finally:
        code = server.stop()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    result.update(command=server.command, log=str(server.log_path), exit_code=code)
    tail = server.log_tail(4000)
    if "Traceback" in tail or code not in (0, -15, None):
        result["log_tail"] = tail[-1500:]
    return result


# --- orchestration -------------------------------------------------------------------------


def build_groups(args: argparse.Namespace) -> list[tuple[str | None, list[Job], bool]]:
    """(model, jobs, run in-process?) per model group."""
    served = {}
    default_served = None
    for item in args.served_model:
        name, sep, value = item.partition("=")
        if sep:
            served[name] = value
        else:
            default_served = item
    commands = {}
    if args.launch is not None:
        for name in [n.strip() for n in args.launch.split(",") if n.strip()]:
            if name not in _launch.BUILTIN_COMMANDS:
                raise SystemExit(f"--launch: unknown server {name!r}; use --launch-cmd")
            commands[name] = _launch.BUILTIN_COMMANDS[name]
    commands.update(pairs(args.launch_cmd, "--launch-cmd"))
    targets = pairs(args.target, "--target")

    models: list[str | None] = [str(Path(m).resolve()) for m in args.model]
    if args.inprocess:
        ip = str(Path(args.inprocess).resolve())
        if ip not in models:
            models.insert(0, ip)
    if not models:
        models = [None]
    groups = []
    for i, model in enumerate(models):
        jobs = []
        if i == 0:
            for name, url in targets.items():
                url = _client.check_loopback(url)
                jobs.append(Job(name, url=url, served_model=served.get(name, default_served)))
        if model is not None:
            for name, cmd in commands.items():
                jobs.append(
                    Job(name, command=cmd, served_model=served.get(name, default_served) or model)
                )
        inproc = (
            args.inprocess is not None
            and model is not None
            and (args.inprocess == "" or str(Path(args.inprocess).resolve()) == model)
        )
        groups.append((model, jobs, inproc))
    return groups


def merged(per_source: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """One model's results so far: the ceiling's and each source's repeats merged."""
    mres: dict[str, Any] = {
        "targets": {n: merge_repeats(runs) for n, runs in per_source.items() if n != "inprocess"}
    }
    if "inprocess" in per_source:
        mres["inprocess"] = merge_repeats(per_source["inprocess"])
    return mres


def save(args: argparse.Namespace, results: dict[str, Any], started: float) -> None:
    results["elapsed_s"] = round(time.time() - started, 1)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2, default=str))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, __doc__.split("\n\n")[0])
    if args.report:
        try:
            models = json.loads(args.report.read_text())["models"].items()
            tables = [f"\n## {label}\n\n{markdown_table(table_rows(m))}" for label, m in models]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            print(f"--report {args.report}: not a serving run's JSON ({exc!r})", file=sys.stderr)
            return 2
        print("\n".join(tables))
        return 0
    CLIENT_NICE[0] = args.client_nice
    if args.vllm_mlx_cmd is None:
        found = shutil.which("vllm-mlx")
        fallback = Path("/tmp/vllm-venv/bin/vllm-mlx")
        args.vllm_mlx_cmd = found or (str(fallback) if fallback.exists() else "vllm-mlx")
    blas = _launch.resolve_blas(args.blas)
    env = _launch.child_env(blas)
    info = machine_info(blas)
    work = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    log_dir = args.log_dir or work
    log_dir.mkdir(parents=True, exist_ok=True)
    groups = build_groups(args)
    started = time.time()
    results: dict[str, Any] = {
        "machine": info,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "models": {},
    }
    job_base = 0
    for model, jobs, inproc in groups:
        label = model or "served"
        bank = _prompts.PromptBank(args, model or args.tokenizer)
        per_source: dict[str, list[dict[str, Any]]] = {}
        # Repeats are the outer loop, so that every source sees each stretch of machine
        # noise (e.g. other processes on a shared box) about equally. Interleaved (the
        # default), each level runs on every source back to back, in an order reversed on
        # every other repeat: the ceiling and the servers compared at one level are measured
        # within a minute or two of each other, so the drift of a shared machine over a run
        # cancels out of their ratio instead of landing on one side of it.
        sources: list[Job | None] = ([None] if inproc and model else []) + list(jobs)
        plan = [[c] for c in args.levels] if args.interleave else [list(args.levels)]
        for r in range(args.repeats):
            for levels in plan:
                for source in sources if r % 2 == 0 or not args.interleave else sources[::-1]:
                    if source is None:
                        assert model is not None
                        idle = _cpu.wait_idle(args.wait_idle, args.idle_threshold, "inprocess")
                        res = _ceiling.run_inprocess(args, model, bank, env, work, r, levels)
                        per_source.setdefault("inprocess", []).append({**res, **idle})
                    else:
                        i = jobs.index(source)
                        idle = _cpu.wait_idle(args.wait_idle, args.idle_threshold, source.name)
                        res = run_job(
                            args, source, job_base + i, bank, model, env, log_dir, r, levels
                        )
                        per_source.setdefault(source.name, []).append({**res, **idle})
                    # after each source, so that a run cut short keeps what it measured
                    results["models"][label] = merged(per_source)
                    save(args, results, started)
        job_base += len(jobs)
        mres = results["models"][label] = merged(per_source)
        rows = table_rows(mres)
        per_level = args.requests or f"max(4c,{args.min_requests})"
        print(f"\n## {label}\n")
        print(machine_header(info))
        print(
            f"- {args.prompt_tokens} prompt tokens (target), {args.max_tokens} output tokens, "
            f"ignore_eos={not args.no_ignore_eos}, repeats={args.repeats} (medians), "
            f"requests/level={per_level}\n"
        )
        print(markdown_table(rows))
        for row in rows:
            if row["failures"]:
                what = ", ".join(f"{n}x {e}" for e, n in row["error_samples"].items())
                print(f"\n- {row['target']} c={row['concurrency']} failures: {what}")
        for name, res in mres["targets"].items():
            if res.get("error"):
                print(f"\n- {name}: {res['error'].splitlines()[0]}")
        if mres.get("inprocess", {}).get("error"):
            print(f"\n- inprocess: {mres['inprocess']['error']}")
        sys.stdout.flush()
        save(args, results, started)
    if args.out:
        print(f"\nJSON: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
