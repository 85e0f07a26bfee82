"""Soak: streamed chat requests against a gateway whose worker is killed or frozen on a
timer, with clients that go away mid-stream; counts what each request got in the end.

    python -m benchmarks.soak [--model PATH] [--requests 1500] [--concurrency 64]
        [--fault-every 20] [--disconnect 0.1] [--duration S] [--json out.json]

It launches the gateway on 127.0.0.1 (one model: `--model`, default the built-in demo), and
runs `--requests` streamed chat requests `--concurrency` at a time (or until `--duration`
seconds have passed), each with a random prompt and length, greedy or sampled. Each worker,
once it has served `--fault-every` seconds since it was ready, gets SIGKILL or SIGSTOP in turn
(a frozen worker is killed by the gateway's liveness watch after `--heartbeat-timeout`).
Faults are timed from Ready, not from the last fault: a worker killed the moment it came up,
again and again, is what a poison request looks like, and the gateway rightly ends a
request that was being tried alone each time (`server.resume_max`). A `--disconnect`
share of the clients close their stream after a few chunks. At the end it prints:

- requests, completed, disconnected (by the client), errored (by reason), lost (no
  terminal answer: a stream that ended without `[DONE]` or an error, or no byte for
  `--read-timeout` seconds);
- how many requests were in flight when a fault came, and how many of those completed;
  the gateway's own count of requests resumed, replayed and failed after a crash;
- faults, worker restarts; the gateway's memory (its processes, not the workers) and the
  worker's at the start (after a warm-up) and at the end; processes left once it stopped.

It exits 1 when a request was lost, when a request in flight at a fault ended in an error,
or when the gateway's memory grew more than 10 %. Not part of the test suite: it runs for
minutes. docs/operations.md quotes its figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path

import httpx
import psutil

from benchmarks._launch import (
    GATEWAY_COMMAND,
    Server,
    child_env,
    gateway_run_dir,
    resolve_blas,
    wait_models_ready,
    write_gateway_config,
)

NAME = "soak"
WORDS = ["river", "stone", "lamp", "orchard", "violin", "harbor", "meadow", "lantern"]


@dataclass
class Faults:
    count: int = 0  # faults so far: a request that saw this change had its worker die
    kinds: Counter[str] = field(default_factory=Counter)


@dataclass
class Report:
    requests: int = 0
    completed: int = 0
    disconnected: int = 0
    errored: Counter[str] = field(default_factory=Counter)
    lost: Counter[str] = field(default_factory=Counter)
    under_fault: int = 0  # in flight when a fault came (and not disconnected by us)
    under_fault_completed: int = 0
    under_fault_errored: int = 0
    pauses: list[float] = field(default_factory=list)  # the longest wait for data, per faulted
    faults: dict[str, int] = field(default_factory=dict)
    restarts: int = 0
    after_crash: dict[str, float] = field(default_factory=dict)
    gateway_mb: tuple[float, float] = (0.0, 0.0)
    worker_mb: tuple[float, float] = (0.0, 0.0)
    left_behind: list[int] = field(default_factory=list)
    seconds: float = 0.0


def admin_ps(run_dir: Path) -> dict[str, object]:
    transport = httpx.HTTPTransport(uds=str(run_dir / "admin.sock"))
    with httpx.Client(transport=transport, base_url="http://gw", timeout=10) as admin:
        rows = admin.get("/ps").json()
    return next(r for r in rows if r["model"] == NAME)


def after_crash(url: str) -> dict[str, float]:
    """The gateway's mlxgw_requests_after_crash_total for the model, by outcome."""
    text = httpx.get(url + "/metrics", timeout=10).text
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("mlxgw_requests_after_crash_total{") and f'model="{NAME}"' in line:
            outcome = line.split('outcome="')[1].split('"')[0]
            found[outcome] = float(line.rsplit(" ", 1)[1])
    return found


def memory_mb(root: int, run_dir: Path) -> tuple[float, float]:
    """(the gateway's processes, the model's worker) resident memory in MiB."""
    worker = admin_ps(run_dir).get("pid")
    gateway = worker_rss = 0
    for proc in [psutil.Process(root), *psutil.Process(root).children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            rss = proc.memory_info().rss
            if proc.pid == worker:
                worker_rss = rss
            elif worker is None or worker not in [p.pid for p in proc.parents()]:
                gateway += rss
    return round(gateway / 2**20, 1), round(worker_rss / 2**20, 1)


def wait_serving(url: str, run_dir: Path, timeout: float) -> None:
    """Until the model is ready on a worker that is not frozen (SIGSTOP: the liveness watch
    kills it after the heartbeat timeout, and a new one comes up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = admin_ps(run_dir).get("pid")
        with contextlib.suppress(psutil.Error):
            if isinstance(pid, int) and psutil.Process(pid).status() != psutil.STATUS_STOPPED:
                wait_models_ready(url, max(1.0, deadline - time.monotonic()))
                return
        time.sleep(0.2)
    raise RuntimeError(f"model not serving after {timeout:.0f}s")


def body(rng: random.Random, max_tokens: int) -> dict[str, object]:
    topic = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))
    sampled = rng.random() < 0.5
    return {
        "model": NAME,
        "messages": [{"role": "user", "content": f"Write about {topic}."}],
        "max_tokens": rng.randint(8, max_tokens),
        "temperature": 0.8 if sampled else 0.0,
        **({"seed": rng.randint(0, 2**31)} if sampled else {}),
        "stream": True,
        "ignore_eos": True,
    }


async def one(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, object],
    leave_after: int | None,
    faults: Faults,
    report: Report,
) -> None:
    seen = faults.count
    outcome = "lost: the stream ended without [DONE]"
    longest, last = 0.0, time.monotonic()
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=payload) as r:
            if r.status_code != 200:
                error = json.loads(await r.aread()).get("error", {})
                outcome = f"error: {r.status_code} {error.get('code') or error.get('type')}"
            else:
                chunks = 0
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue  # a keep-alive comment (or a blank line) is no data
                    now = time.monotonic()
                    longest, last = max(longest, now - last), now
                    if line == "data: [DONE]":
                        outcome = "completed"
                        break
                    data = json.loads(line[6:])
                    if "error" in data:
                        outcome = f"error: {data['error'].get('code') or data['error'].get('type')}"
                        break
                    chunks += 1
                    if leave_after is not None and chunks >= leave_after:
                        outcome = "disconnected"
                        break
    except httpx.TimeoutException:
        outcome = "lost: no byte within --read-timeout"
    except (httpx.HTTPError, ValueError) as exc:
        outcome = f"lost: {type(exc).__name__}"
    faulted = faults.count != seen and outcome != "disconnected"
    report.under_fault += faulted
    if faulted:
        report.pauses.append(round(longest, 2))
    if outcome == "completed":
        report.completed += 1
        report.under_fault_completed += faulted
    elif outcome == "disconnected":
        report.disconnected += 1
    elif outcome.startswith("error"):
        report.errored[outcome[7:]] += 1
        report.under_fault_errored += faulted
    else:
        report.lost[outcome[6:]] += 1


async def fault_loop(run_dir: Path, every: float, faults: Faults, stop: asyncio.Event) -> None:
    """A fault for each worker once it has been ready for `every` seconds."""
    kinds = [signal.SIGKILL, signal.SIGSTOP]
    ready: tuple[int, float] | None = None  # the worker seen ready, and since when
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), min(every, 0.2))
        if stop.is_set():
            return
        row = await asyncio.to_thread(admin_ps, run_dir)
        pid = row.get("pid")
        if row.get("state") != "ready" or not isinstance(pid, int):
            continue  # still restarting after the last fault
        if ready is None or ready[0] != pid:
            ready = (pid, time.monotonic())
        if time.monotonic() - ready[1] < every:
            continue
        ready = (pid, math.inf)  # one fault per worker: a frozen one stays "ready" a while
        sig = kinds[faults.count % 2]
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
            faults.count += 1
            faults.kinds[sig.name] += 1


async def drive(args: argparse.Namespace, server: Server, run_dir: Path) -> Report:
    report, faults = Report(), Faults()
    rng = random.Random(args.seed)
    timeout = httpx.Timeout(10.0, read=args.read_timeout)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        warm = Report()  # a warm-up round: the memory figures start after it
        await asyncio.gather(
            *(
                one(client, server.url, body(rng, 32), None, faults, warm)
                for _ in range(args.concurrency)
            )
        )
        start_mem = memory_mb(server.proc.pid, run_dir)
        crash_before = after_crash(server.url)
        restarts_before = int(admin_ps(run_dir)["restarts"])  # type: ignore[call-overload]
        stop = asyncio.Event()
        faulting = asyncio.create_task(fault_loop(run_dir, args.fault_every, faults, stop))
        started = time.monotonic()
        deadline = started + args.duration if args.duration else float("inf")
        slots = asyncio.Semaphore(args.concurrency)

        async def run(i: int) -> None:
            async with slots:
                if time.monotonic() > deadline:
                    return
                report.requests += 1
                leave = rng.randint(1, 8) if rng.random() < args.disconnect else None
                await one(client, server.url, body(rng, args.max_tokens), leave, faults, report)
                done = report.completed + report.disconnected + sum(report.errored.values())
                done += sum(report.lost.values())
                if args.progress and done % 100 == 0:
                    print(f"  {done} requests answered, {faults.count} faults", flush=True)

        await asyncio.gather(*(run(i) for i in range(args.requests)))
        stop.set()
        await faulting
        report.seconds = round(time.monotonic() - started, 1)
        # the last fault's worker back (a frozen one killed first), then the figures
        await asyncio.to_thread(wait_serving, server.url, run_dir, 120)
        report.faults = dict(faults.kinds)
        report.restarts = int(admin_ps(run_dir)["restarts"]) - restarts_before  # type: ignore[call-overload]
        end = after_crash(server.url)
        report.after_crash = {k: end.get(k, 0) - crash_before.get(k, 0) for k in end}
        end_mem = memory_mb(server.proc.pid, run_dir)
        report.gateway_mb = (start_mem[0], end_mem[0])
        report.worker_mb = (start_mem[1], end_mem[1])
    return report


def print_report(r: Report) -> None:
    print(f"requests            {r.requests} in {r.seconds:.0f} s")
    print(f"completed           {r.completed}")
    print(f"disconnected        {r.disconnected} (by the client)")
    print(f"errored             {sum(r.errored.values())} {dict(r.errored) or ''}")
    print(f"lost                {sum(r.lost.values())} {dict(r.lost) or ''}")
    print(
        f"under a fault       {r.under_fault}: {r.under_fault_completed} completed, "
        f"{r.under_fault_errored} errored"
    )
    if r.pauses:
        pauses = sorted(r.pauses)
        median, worst = pauses[len(pauses) // 2], pauses[-1]
        print(f"pause under a fault median {median:.1f} s, longest {worst:.1f} s (no data)")
    print(f"after a crash       {r.after_crash} (the gateway's count)")
    print(f"faults              {r.faults}; worker restarts {r.restarts}")
    print(f"gateway memory      {r.gateway_mb[0]:.0f} -> {r.gateway_mb[1]:.0f} MiB")
    print(f"worker memory       {r.worker_mb[0]:.0f} -> {r.worker_mb[1]:.0f} MiB")
    print(f"left behind         {r.left_behind or 'none'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin:demo", help="a model folder or hub id")
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration", type=float, default=0, help="stop after S seconds")
    parser.add_argument("--fault-every", type=float, default=20.0)
    parser.add_argument("--disconnect", type=float, default=0.1)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0)
    parser.add_argument("--read-timeout", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--blas", default="auto", help="auto | off | a libopenblas path")
    parser.add_argument("--json", type=Path, help="write the report here too")
    parser.add_argument("--progress", action="store_true")
    args = parser.parse_args(argv)

    run_dir = gateway_run_dir()
    engine: dict[str, bool | int | float | str] = {"max_running": args.concurrency}
    server_settings: dict[str, bool | int | float | str] = {
        "heartbeat_timeout_s": args.heartbeat_timeout,
        "request_timeout_s": 600.0,
    }
    config = write_gateway_config(
        run_dir / "gateway.toml", run_dir, args.model, NAME, engine, server_settings
    )
    launch = {"python": sys.executable, "config": str(config)}
    env = child_env(resolve_blas(args.blas))
    server = Server("gateway", GATEWAY_COMMAND, launch, env, run_dir)
    workers: set[int] = set()
    try:
        server.wait_ready(180)
        wait_models_ready(server.url, 300)
        report = asyncio.run(drive(args, server, run_dir))
        workers = {p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)}
    finally:
        server.stop()
    report.left_behind = sorted(p for p in workers if psutil.pid_exists(p))
    print_report(report)
    if args.json:
        data = {f.name: getattr(report, f.name) for f in fields(report)}
        data = {k: dict(v) if isinstance(v, Counter) else v for k, v in data.items()}
        args.json.write_text(json.dumps(data, indent=2) + "\n")
    grew = report.gateway_mb[1] > 1.10 * report.gateway_mb[0]
    bad = sum(report.lost.values()) or report.under_fault_errored or grew or report.left_behind
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
