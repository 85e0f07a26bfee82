"""Replicas benchmark: one model served by one worker, then by two (the gateway's own and a
worker dialing in over TCP with CURVE, `gatewayctl worker`), under the same closed-loop load.

One gateway is launched on ``--model`` with ``server.workers_listen`` set; each repeat
measures the level with the local worker alone, then with a second worker joined (started
here on loopback, its key allowed with ``gatewayctl workers add``), then alone again after
that worker stops (so one replica is measured on both sides of two and drift cancels out).
Per run: output tok/s, TTFT p50, and each replica's share of the requests; the table shows
medians over ``--repeats`` and the ratio two/one. Every prompt is unique (no prefix cache
hits) and about ``--prompt-tokens`` long. Run from the repository root::

    python -m benchmarks.replicas --model /tmp/bench-llama --concurrency 32 --repeats 3

All traffic goes to 127.0.0.1; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks import _client, _launch
from benchmarks._prompts import make_prompts
from benchmarks._stats import machine_header, machine_info, summarize_level

NAME = "bench"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model dir")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=0, help="per run (default: 4 x c)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-running", type=int, default=64, help="each worker's batch bound")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--level-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=None, help="JSON results file")
    return p.parse_args(argv)


class Bench:
    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.args = args
        self.root = root
        self.listen = f"127.0.0.1:{_launch.free_port()}"
        run_dir = _launch.gateway_run_dir()
        engine = {"max_running": args.max_running}
        self.config = _launch.write_gateway_config(
            root / "gateway.toml",
            run_dir,
            args.model,
            NAME,
            engine,
            {"workers_listen": self.listen, "cluster_dir": str(root / "cluster")},
        )
        env = _launch.child_env(_launch.resolve_blas("auto"))
        fields = {"python": sys.executable, "config": str(self.config)}
        self.env = env
        self.gateway = _launch.Server("gateway", _launch.GATEWAY_COMMAND, fields, env, root)
        self.worker_home = root / "host-b"
        self.worker_home.mkdir()
        wcfg = self.worker_home / "config.toml"
        wcfg.write_text(
            f'[server]\ncluster_dir = "{self.worker_home / "cluster"}"\n\n[[models]]\n'
            f'name = "{NAME}"\nsource = "{args.model}"\n[models.engine]\n'
            f"max_running = {args.max_running}\n"
        )
        self.worker_config = wcfg
        self.worker: subprocess.Popen[bytes] | None = None

    def ctl(self, config: Path, *args: str) -> str:
        cmd = [sys.executable, "-m", "gateway", "--config", str(config), *args]
        return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60).stdout

    def start_worker(self) -> None:
        key = self.ctl(self.worker_config, "worker", "--show-key").strip()
        if key not in self.ctl(self.config, "workers", "list"):
            self.ctl(self.config, "workers", "add", "b", key)
        gateway_key = self.ctl(self.config, "workers", "key").strip()
        log = open(self.worker_home / "worker.log", "ab")  # noqa: SIM115
        argv = [sys.executable, "-m", "gateway", "--config", str(self.worker_config), "worker"]
        argv += ["--gateway", self.listen, "--gateway-key", gateway_key, "--model", NAME, "--once"]
        self.worker = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
        )
        log.close()
        self.wait_replicas(2)

    def stop_worker(self) -> None:
        if self.worker is not None:
            self.worker.terminate()
            self.worker.wait(60)
            self.worker = None
        self.wait_replicas(1)

    def replicas(self) -> list[dict[str, Any]]:
        transport = httpx.HTTPTransport(uds=str(Path(self._run_dir()) / "admin.sock"))
        with httpx.Client(transport=transport, base_url="http://gw", timeout=10) as admin:
            rows = admin.get("/ps").json()
        return [r for r in rows[0]["replicas"] if r["state"] == "ready"]

    def _run_dir(self) -> str:
        for line in self.config.read_text().splitlines():
            if line.startswith("run_dir"):
                return str(json.loads(line.split("=", 1)[1]))
        raise RuntimeError("no run_dir")

    def wait_replicas(self, n: int) -> None:
        deadline = time.monotonic() + self.args.ready_timeout
        while time.monotonic() < deadline:
            if len(self.replicas()) == n:
                return
            time.sleep(0.2)
        raise RuntimeError(f"not {n} replicas after {self.args.ready_timeout:.0f}s")

    async def level(self, tag: str) -> dict[str, Any]:
        args = self.args
        c = args.concurrency
        n = args.requests or 4 * c
        prompts = make_prompts(0, n, tag, args.prompt_tokens, None)
        before = {r["worker_id"]: r["requests"] for r in self.replicas()}
        async with _client.make_client(c, 300.0) as client:
            records, wall = await _client.run_level(
                client,
                self.gateway.url,
                NAME,
                prompts,
                c,
                args.max_tokens,
                True,
                args.level_timeout,
            )
        summary = summarize_level(records, wall, c, args.max_tokens)
        after = {r["worker_id"]: r["requests"] for r in self.replicas()}
        summary["shares"] = {k: v - before.get(k, 0) for k, v in after.items()}
        return summary


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="replicas") as tmp:
        bench = Bench(args, Path(tmp))
        try:
            bench.gateway.wait_ready(args.ready_timeout)
            _launch.wait_models_ready(bench.gateway.url, args.ready_timeout)
            await bench.level("warm")
            runs: dict[str, list[dict[str, Any]]] = {"one": [], "two": []}
            for repeat in range(args.repeats):
                runs["one"].append(await bench.level(f"r{repeat}one"))
                bench.start_worker()
                runs["two"].append(await bench.level(f"r{repeat}two"))
                bench.stop_worker()
            runs["one"].append(await bench.level("last-one"))
        finally:
            if bench.worker is not None:
                bench.worker.terminate()
                bench.worker.wait(60)
            bench.gateway.stop()
    return runs


def report(runs: dict[str, Any], args: argparse.Namespace) -> str:
    def med(rows: list[dict[str, Any]], key: str) -> float | None:
        values = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(values) if values else None

    one, two = med(runs["one"], "output_tok_s"), med(runs["two"], "output_tok_s")
    ttft1, ttft2 = med(runs["one"], "ttft_p50_ms"), med(runs["two"], "ttft_p50_ms")
    lines = [
        f"concurrency {args.concurrency}, {args.max_tokens} tokens per request, "
        f"{args.repeats} repeats (medians)",
        "",
        "| replicas | output tok/s | TTFT p50 ms | requests per replica (last run) |",
        "|---|---|---|---|",
        f"| 1 | {one:.0f} | {ttft1:.0f} | {runs['one'][-1]['shares']} |"
        if one is not None and ttft1 is not None
        else "| 1 | - | - | - |",
        f"| 2 | {two:.0f} | {ttft2:.0f} | {runs['two'][-1]['shares']} |"
        if two is not None and ttft2 is not None
        else "| 2 | - | - | - |",
    ]
    if one and two:
        lines += ["", f"two replicas / one: {two / one:.2f}x output tok/s"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(machine_header(machine_info(_launch.resolve_blas("auto"))))
    runs = asyncio.run(run(args))
    print(report(runs, args))
    if args.out is not None:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, **runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
