"""Agent-session benchmark: first-token time per turn of multi-turn sessions (prefix reuse).

Every session shares one system prompt of ``--system-tokens`` tokens and has its own first
user message; each turn sends the whole conversation so far plus a new user message of
100-200 tokens (a tool result), as a streaming chat completion (temperature 0,
``--max-tokens``), and keeps the reply as the server returned it (benchmarks/_agent_trace.py,
_agent_client.py). Per turn: TTFT, total time, prompt and cached tokens (from ``usage``),
medians across sessions and then across repeats; the table shows each source's TTFT and its
ratio to the baseline's (``--baseline``, the gateway with its prefix cache on).

Sources are launched here on ``--model`` (``--sources gateway,gateway-nocache,mlx_lm,
vllm_mlx``; ``gateway-nocache`` is the gateway with ``engine.prefix_cache = false``,
``gateway-rows`` (not by default) with ``engine.batcher = "rows"``) or are
already running (``--url [NAME=]URL``, e.g. on a GPU machine where servers are started
separately). Run from the repository root::

    python -m benchmarks.agent_session --model /tmp/bench-llama-8k --sessions 1,4 \\
        --sources gateway,gateway-nocache,mlx_lm --out /tmp/agent.json

    python -m benchmarks.agent_session --url gateway=http://127.0.0.1:8000 --model bench \\
        --tokenizer /path/to/model --sessions 4

All traffic goes to 127.0.0.1; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import _client, _cpu, _launch
from benchmarks._agent_client import Target, TurnRecord, chat_body, run_sessions, send_turn
from benchmarks._agent_report import (
    markdown_table,
    merge_runs,
    ratios,
    summarize_turns,
    target_check,
)
from benchmarks._agent_sources import (
    GATEWAY_ENGINE,
    GATEWAY_ENV,
    GATEWAY_MODEL_NAME,
    KNOWN,
    SOURCES,
    Source,
)
from benchmarks._agent_trace import ChatTokens, Trace, build_trace
from benchmarks._stats import machine_header, machine_info
from shared.blas import CUDNN_SDPA


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.agent_session",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default=None,
        help="model dir (servers launched here serve it; it calibrates the trace), or with "
        "--url only, the model id to send",
    )
    p.add_argument("--url", action="append", default=[], metavar="[NAME=]URL")
    p.add_argument(
        "--served-model",
        action="append",
        default=[],
        metavar="[NAME=]ID",
        help="model id sent to --url servers (to the one named NAME with NAME=; default: "
        "--model if it is not a directory, else the last id each server lists)",
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: --model's)")
    p.add_argument(
        "--sources",
        default=None,
        help=f"servers to launch on --model (default without --url: {','.join(SOURCES)})",
    )
    p.add_argument("--vllm-mlx-cmd", default=None, help="vllm-mlx executable")
    p.add_argument("--sessions", default="1", help="concurrent sessions, e.g. 1,4")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=4096)
    p.add_argument("--user-tokens", default="100,200", help="MIN,MAX tokens of a user turn")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--ignore-eos",
        default="gateway,gateway-nocache,gateway-rows,gateway-rows-nocache",
        metavar="NAMES",
        help="sources sent ignore_eos (mlx_lm server and vllm-mlx ignore it)",
    )
    p.add_argument(
        "--no-lockstep",
        dest="lockstep",
        action="store_false",
        help="each session sends its next turn as soon as it has a reply (default: turn t of "
        "every session goes together)",
    )
    p.add_argument(
        "--no-account",
        dest="account",
        action="store_false",
        help="no scrape of the gateway's /metrics before and after each measured turn (its "
        "own account of where the turn's first tokens waited): the measured turns then follow "
        "each other with no idle spell between them, as the warm trace's do",
    )
    p.add_argument("--baseline", default="gateway", help="the source ratios are taken to")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument(
        "--warm-trace",
        action="store_true",
        help="before the measured trace, run one of other text and the same lengths (a server "
        "that has met this trace's shapes, as an always-on one has); its turns are reported "
        "as the fresh server's",
    )
    p.add_argument("--blas", default="auto", help="auto | off | path of a BLAS to LD_PRELOAD")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--wait-idle", type=float, default=60.0, help="max wait for an idle machine")
    p.add_argument("--idle-threshold", type=float, default=30.0, help="idle: < this CPU %%")
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default: temp)")
    p.add_argument("--out", type=Path, default=None, help="JSON results file")
    args = p.parse_args(argv)
    try:
        args.session_counts = [int(x) for x in args.sessions.split(",") if x.strip()]
        args.user_range = tuple(int(x) for x in args.user_tokens.split(","))
    except ValueError:
        p.error("--sessions and --user-tokens take comma-separated integers")
    if not args.session_counts or not all(1 <= n <= 64 for n in args.session_counts):
        p.error("--sessions: integers in 1..64")
    if len(args.user_range) != 2 or not 1 <= args.user_range[0] <= args.user_range[1]:
        p.error("--user-tokens: MIN,MAX with 1 <= MIN <= MAX")
    if not 1 <= args.turns <= 64 or not 1 <= args.repeats <= 20:
        p.error("--turns: 1..64, --repeats: 1..20")
    model_dir = args.model and Path(args.model).is_dir()
    if args.sources is None:
        args.sources = "" if args.url else ",".join(SOURCES)
    args.source_names = [n.strip() for n in args.sources.split(",") if n.strip()]
    if unknown := set(args.source_names) - set(KNOWN):
        p.error(f"--sources: unknown {sorted(unknown)}; known: {', '.join(KNOWN)}")
    if args.source_names and not model_dir:
        p.error("launching servers needs --model DIR")
    if not args.source_names and not args.url:
        p.error("nothing to measure: give --sources or --url")
    args.tokenizer = args.tokenizer or (args.model if model_dir else None)
    args.served = {}
    for item in args.served_model:
        name, sep, value = item.partition("=")
        args.served[name if sep else ""] = value if sep else item
    if args.model and not model_dir:
        args.served.setdefault("", args.model)
    return args


def build_sources(args: argparse.Namespace) -> list[Source]:
    eos = {n.strip() for n in args.ignore_eos.split(",")}
    sources = []
    for i, item in enumerate(args.url):
        name, sep, url = item.partition("=")
        if not sep or "://" in name:
            name, url = ("url" if len(args.url) == 1 else f"url{i + 1}"), item
        url = _client.check_loopback(url)
        model_id = args.served.get(name, args.served.get(""))
        sources.append(Source(name, url=url, model_id=model_id, ignore_eos=name in eos))
    for name in args.source_names:
        if name in GATEWAY_ENGINE:
            command, model_id = _launch.GATEWAY_COMMAND, GATEWAY_MODEL_NAME
        else:
            command, model_id = _launch.BUILTIN_COMMANDS[name], str(Path(args.model).resolve())
        if name == "vllm_mlx" and not shutil.which(args.vllm_mlx_cmd):
            print(
                f"[vllm_mlx] skipped: {args.vllm_mlx_cmd!r} not found (install it in its own "
                "venv, see benchmarks/README.md, and pass --vllm-mlx-cmd)",
                file=sys.stderr,
            )
            continue
        engine = GATEWAY_ENGINE.get(name, {})
        sources.append(
            Source(
                name,
                command=command,
                model_id=model_id,
                engine=engine,
                ignore_eos=name in eos,
                env=GATEWAY_ENV.get(name, {}),
            )
        )
    return sources


# --- one source, one repeat ----------------------------------------------------------------


async def measure(
    args: argparse.Namespace,
    source: Source,
    url: str,
    trace: Trace,
    warm_trace: Trace | None,
    on_start: Callable[[], object] = lambda: None,
) -> dict:
    """Warm up (a short unrelated request, then ``warm_trace`` if given), then every session
    of ``trace`` (``on_start`` called just before it)."""
    client = _client.make_client(trace.sessions, args.request_timeout)
    async with client:
        model_id = await _client.served_model(client, url, source.model_id)
        warm = TurnRecord(-1, 0)
        hello = [{"role": "user", "content": "Say hello to the benchmark."}]
        await send_turn(client, url, chat_body(model_id, hello, 8, source.ignore_eos), warm)
        if warm.error and not warm.error.startswith("empty"):  # an EOS at once is fine
            return {"model_id": model_id, "error": f"warm-up failed: {warm.error}"}
        target = Target(url, model_id, args.max_tokens, source.ignore_eos)
        fresh: dict[str, Any] = {}
        if warm_trace is not None:
            records = await run_sessions(client, target, warm_trace, args.lockstep)
            fresh["fresh_turns"] = summarize_turns(records, warm_trace.turns)
            if any(r.error for session in records for r in session):
                return {"model_id": model_id, "error": "warm trace failed", **fresh}
        on_start()
        shares: list[dict[str, float]] = []
        sys0, t0, cpu0 = _cpu.snapshot(), time.perf_counter(), time.process_time()
        accounted = shares if args.account else None
        records = await run_sessions(client, target, trace, args.lockstep, accounted)
        sys1, wall = _cpu.snapshot(), time.perf_counter() - t0
        client_cpu = round(100 * (time.process_time() - cpu0) / wall, 1)
    return {
        "model_id": model_id,
        "warmup_ttft_ms": round((warm.ttft or 0.0) * 1000, 1),
        "wall_s": round(wall, 2),
        "system_cpu_pct": _cpu.busy_pct(sys0, sys1),
        "client_cpu_pct": client_cpu,
        "steal_pct": _cpu.steal_pct(sys0, sys1),
        "turns": summarize_turns(records, trace.turns),
        "worker_share": shares if any(shares) else [],  # per turn, the gateway's own account
        **fresh,
        "records": [r.to_dict() for session in records for r in session],
    }


def worker_share_line(shares: list[dict[str, float]]) -> str:
    """Per turn, where its first tokens waited in the worker (means over its sessions, ms):
    preparing the prompt / queued / prefilling to the first token, and the gateway's first
    token (the rest of the client's is the way out to it)."""
    keys = ("preprocess_mean_ms", "queue_mean_ms", "prefill_mean_ms", "gateway_ttft_mean_ms")
    turns = ["/".join(f"{share[k]:.1f}" if k in share else "-" for k in keys) for share in shares]
    return "worker preprocess/queue/prefill, gateway TTFT ms per turn: " + " ".join(turns)


def _run(coro: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def run_source(
    args: argparse.Namespace,
    source: Source,
    traces: tuple[Trace, Trace | None],
    env: dict[str, str],
    log_dir: Path,
) -> dict[str, Any]:
    """One repeat of one source: launch it if needed, measure (``traces``: the measured one
    and the one to warm the server with, if any), stop it."""
    if source.url:
        return dict(_run(measure(args, source, source.url, *traces)), url=source.url)
    assert source.command is not None
    fields = {
        "model": str(Path(args.model).resolve()),
        "max_concurrency": str(max(*args.session_counts, 8)),
        "python": sys.executable,
        "vllm_mlx_cmd": args.vllm_mlx_cmd,
    }
    scratch: list[Path] = []
    env = {**env, **source.env}
    if source.name in GATEWAY_ENGINE:
        run_dir = _launch.gateway_run_dir()
        scratch.append(run_dir)
        config = log_dir / f"{source.name}-{run_dir.name}.toml"
        _launch.write_gateway_config(
            config, run_dir, fields["model"], GATEWAY_MODEL_NAME, source.engine
        )
        fields["config"] = str(config)
    if source.name in _launch.PRIVATE_HOME:  # vllm-mlx writes its prefix cache under ~/.cache
        scratch.append(Path(tempfile.mkdtemp(prefix=f"{source.name}-home-", dir=log_dir)))
        env = {**env, "HOME": str(scratch[-1])}
    try:
        server = _launch.Server(source.name, source.command, fields, env, log_dir)
    except (OSError, KeyError, ValueError) as e:
        for path in scratch:
            shutil.rmtree(path, ignore_errors=True)
        return {"error": f"cannot launch {source.command!r}: {e!r}"}
    print(f"[{source.name}] launching: {server.command}", file=sys.stderr, flush=True)
    try:
        server.wait_ready(args.ready_timeout)
        if source.name in GATEWAY_ENGINE:
            _launch.wait_models_ready(server.url, args.ready_timeout)
        started: list[float | None] = []  # the server's CPU time as the measured trace starts
        result = _run(
            measure(args, source, server.url, *traces, lambda: started.append(server.cpu_seconds()))
        )
        cpu0, cpu1 = (started or [None])[0], server.cpu_seconds()
        if cpu0 is not None and cpu1 is not None and result.get("wall_s"):
            server_cpu = round(100 * (cpu1 - cpu0) / result["wall_s"], 1)
            result["server_cpu_pct"] = server_cpu
            if result.get("system_cpu_pct") is not None:
                # CPU used by neither this client nor the server: other processes.
                other = result["system_cpu_pct"] - result["client_cpu_pct"] - server_cpu
                result["other_cpu_pct"] = round(other, 1)
        result.update(ready_s=round(server.ready_s or 0.0, 2), server_rss_mb=server.rss_mb())
        if source.name in GATEWAY_ENGINE:  # its workers' attention under CUDA (0: the default)
            result["cudnn_sdpa"] = env.get(CUDNN_SDPA, "0")
    except RuntimeError as e:
        result = {"error": str(e)}
    finally:
        code = server.stop()
        for path in scratch:
            shutil.rmtree(path, ignore_errors=True)
    result.update(command=server.command, log=str(server.log_path), exit_code=code)
    if "Traceback" in server.log_tail(4000):
        result["log_tail"] = server.log_tail(1500)
    return result


# --- orchestration -------------------------------------------------------------------------


def run_variant(
    args: argparse.Namespace,
    sessions: int,
    sources: list[Source],
    tokens: ChatTokens | None,
    env: dict[str, str],
    log_dir: Path,
) -> dict[str, Any]:
    """Every repeat of every source with ``sessions`` concurrent sessions. Within a repeat
    all sources run the same trace (a fresh one per repeat, so no cache carries over), in
    an order reversed on every other repeat."""
    nonce = secrets.token_hex(3)
    runs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in sources}
    for r in range(args.repeats):
        tag = f"{nonce}s{sessions}r{r}"
        shape = (sessions, args.turns, args.system_tokens, args.user_range, tokens)
        trace = build_trace(tag, *shape)
        warm = build_trace(f"{tag}w", *shape) if args.warm_trace else None
        for source in sources if r % 2 == 0 else sources[::-1]:
            idle = _cpu.wait_idle(args.wait_idle, args.idle_threshold, source.name)
            res = {**run_source(args, source, (trace, warm), env, log_dir), **idle, "repeat": r}
            runs[source.name].append(res)
            turns = res.get("turns") or []
            ttfts = " ".join(f"{t['ttft_ms']}" for t in turns)
            fresh = " ".join(f"{t['ttft_ms']}" for t in res.get("fresh_turns") or [])
            print(
                f"[{source.name}] sessions={sessions} rep={r} TTFT ms per turn: {ttfts} "
                + (f"(fresh server: {fresh}) " if fresh else "")
                + f"{res.get('error') or ''}",
                file=sys.stderr,
                flush=True,
            )
            if res.get("worker_share"):
                print(f"[{source.name}] {worker_share_line(res['worker_share'])}", file=sys.stderr)
    per_turn = {
        name: merge_runs([res["turns"] for res in rs if res.get("turns")])
        if all(res.get("turns") for res in rs)
        else []
        for name, rs in runs.items()
    }
    by_source = ratios(per_turn, args.baseline)
    fresh = {
        name: merge_runs([res["fresh_turns"] for res in rs])
        for name, rs in runs.items()
        if rs and all(res.get("fresh_turns") for res in rs)
    }
    return {
        "sessions": sessions,
        "turns": per_turn,
        "fresh_turns": fresh,
        "fresh_ratios": ratios(fresh, args.baseline) if fresh else {},
        "ratios": by_source,
        "target": target_check(by_source, args.baseline),
        "runs": runs,
    }


def report(args: argparse.Namespace, variant: dict[str, Any], info: dict[str, Any]) -> None:
    lock = "lockstep" if args.lockstep else "free-running"
    print(f"\n## {variant['sessions']} session(s), {args.turns} turns\n")
    print(machine_header(info))
    print(
        f"- model {args.model}; system prompt {args.system_tokens} tokens (target), user turns "
        f"{args.user_range[0]}-{args.user_range[1]} tokens, max_tokens {args.max_tokens}, "
        f"sessions {lock}, repeats={args.repeats} (medians)\n"
        f"- TTFT: median over sessions, then over repeats; [cached tokens] where reported; "
        f"NAME/base: TTFT over {args.baseline}'s\n"
    )
    if variant.get("fresh_turns"):
        print("A fresh server (the warm trace):\n")
        print(markdown_table(variant["fresh_turns"], variant["fresh_ratios"]))
        print("\nThe same server after it (the measured trace):\n")
    print(markdown_table(variant["turns"], variant["ratios"]))
    if variant["target"]:
        print("\nTarget:\n" + "\n".join(variant["target"]))
    print("\nRuns (CPU in % of one core; bg: used by other processes, on a shared machine):")
    for name, runs in variant["runs"].items():
        for res in runs:
            head = f"- {name} repeat {res['repeat']}:"
            if res.get("error"):
                print(f"{head} {res['error'].splitlines()[0]}")
                continue
            print(
                f"{head} ready {res.get('ready_s', '-')} s, {res.get('wall_s')} s, server CPU "
                f"{res.get('server_cpu_pct', '-')}, bg CPU {res.get('other_cpu_pct', '-')}, "
                f"steal {res.get('steal_pct', '-')}"
            )
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.vllm_mlx_cmd is None:
        fallback = Path("/tmp/vllm-venv/bin/vllm-mlx")
        found = shutil.which("vllm-mlx")
        args.vllm_mlx_cmd = found or (str(fallback) if fallback.exists() else "vllm-mlx")
    sources = build_sources(args)
    if not sources:
        raise SystemExit("nothing to measure")
    tokens = ChatTokens(args.tokenizer) if args.tokenizer else None
    if tokens is None:
        print("no tokenizer: trace lengths are guesses (give --tokenizer)", file=sys.stderr)
    blas = _launch.resolve_blas(args.blas)
    env = _launch.child_env(blas)
    info = machine_info(blas)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-agent-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "machine": info,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "variants": [],
    }
    for sessions in args.session_counts:
        variant = run_variant(args, sessions, sources, tokens, env, log_dir)
        results["variants"].append(variant)
        report(args, variant, info)
        if args.out:  # after each variant, so a later crash keeps what was measured
            args.out.write_text(json.dumps(results, indent=2, default=str))
    if args.out:
        print(f"\nJSON: {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
