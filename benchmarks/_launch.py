"""Start a server as a subprocess on 127.0.0.1 with a free port, wait for it, stop it."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

BLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
)

# Built-in launch commands. Placeholders: {python} {model} {port} {max_concurrency}
# {vllm_mlx_cmd}. Both servers get batch sizes >= the highest concurrency measured.
BUILTIN_COMMANDS = {
    "mlx_lm": (
        "{python} -m mlx_lm server --model {model} --host 127.0.0.1 --port {port}"
        " --decode-concurrency {max_concurrency} --prompt-concurrency {max_concurrency}"
        " --log-level WARNING"
    ),
    "vllm_mlx": (
        "{vllm_mlx_cmd} serve {model} --host 127.0.0.1 --port {port} --continuous-batching"
        " --max-num-seqs {max_concurrency} --prefill-batch-size {max_concurrency}"
        " --completion-batch-size {max_concurrency}"
    ),
}

# Launched with HOME pointing at a scratch directory (removed after the run).
PRIVATE_HOME = {"vllm_mlx"}

# This project's gateway, from a config written by ``write_gateway_config`` ({config}).
GATEWAY_COMMAND = "{python} -m gateway --config {config} serve --port {port}"


def _toml(value: bool | int | float | str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def gateway_run_dir() -> Path:
    """A short run directory: the gateway's unix socket paths must stay under 104 bytes."""
    return Path(tempfile.mkdtemp(prefix="gw", dir="/tmp"))


def write_gateway_config(
    path: Path,
    run_dir: Path,
    model: str,
    name: str,
    engine: dict[str, bool | int | float | str],
    extra: dict[str, bool | int | float | str] | None = None,
) -> Path:
    """A gateway config serving one model as ``name`` with ``engine`` options (e.g.
    ``{"prefix_cache": False}``) and ``extra`` server settings; sockets, logs and an empty
    key file (so a developer's own keys never turn auth on) go under ``run_dir``."""
    server: dict[str, bool | int | float | str] = {
        "run_dir": str(run_dir),
        "keys_file": f"{run_dir}/keys.json",
        "drain_timeout_s": 3.0,
        **(extra or {}),
    }
    lines = ["[server]"] + [f"{k} = {_toml(v)}" for k, v in server.items()]
    lines += ["", "[[models]]", f"name = {_toml(name)}", f"source = {_toml(model)}"]
    if engine:
        lines += ["[models.engine]"] + [f"{k} = {_toml(v)}" for k, v in engine.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def wait_models_ready(url: str, timeout: float) -> None:
    """Poll the gateway's ``GET /health`` until every configured model is ``ready`` (its
    ``/v1/models`` answers before the workers have loaded); bounded by ``timeout``."""
    deadline = time.perf_counter() + timeout
    states: dict[str, str] = {}
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while time.perf_counter() < deadline:
            try:
                states = client.get(url + "/health").json().get("models", {})
            except (httpx.HTTPError, ValueError, AttributeError):
                states = {}
            if states and all(s == "ready" for s in states.values()):
                return
            if "failed" in states.values():
                break
            time.sleep(0.1)
    raise RuntimeError(f"gateway models not ready after {timeout:.0f}s: {states}")


def resolve_blas(setting: str) -> str | None:
    if setting == "off" or not sys.platform.startswith("linux"):
        return None
    if setting == "auto":
        return next((c for c in BLAS_CANDIDATES if Path(c).is_file()), None)
    if not Path(setting).is_file():
        raise SystemExit(f"--blas: {setting} not found")
    return setting


def child_env(blas: str | None) -> dict[str, str]:
    """Environment for servers and the in-process child: exactly one BLAS preload, or none
    (an inherited openblas preload is removed when ``blas`` is None)."""
    env = dict(os.environ)
    parts = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    parts = [p for p in parts if "openblas" not in Path(p).name]
    if blas:
        parts = [blas, *[p for p in parts if p != blas]]
    if parts:
        env["LD_PRELOAD"] = ":".join(parts)
    else:
        env.pop("LD_PRELOAD", None)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


# Set in a benchmark that `as_worker` re-executed (and by the tests, which call benchmarks'
# `main` in pytest's own process): it runs on as it is.
AS_WORKER = "MLXGW_BENCH_AS_WORKER"


def as_worker(module: str, argv: list[str] | None) -> None:
    """Run an in-process benchmark (`python -m module`) under the environment a worker gets
    (shared/blas.py: on a CPU the OpenBLAS preload; MLX's settings), or MLX would run there
    on its reference BLAS where the gateway's worker does not (a 16-layer test model's
    cached agent turns took twice as long): re-executes once, before the benchmark's work,
    where the environment lacks any of it. `MLXGW_BENCH_AS_WORKER=1` keeps the environment
    as it is (to measure MLX's reference BLAS, say)."""
    if os.environ.get(AS_WORKER):
        return
    import mlx.core as mx

    from shared.blas import worker_env

    device = "cpu" if mx.default_device() == mx.cpu else "gpu"
    env = {**worker_env("auto", device=device), AS_WORKER: "1"}
    if all(os.environ.get(key) == value for key, value in env.items() if key != AS_WORKER):
        return
    # the command line as it was (interpreter options, a profiler's -m wrapper), or the
    # module with the arguments main was given
    again = sys.orig_argv[1:] if argv is None else ["-m", module, *argv]
    os.execve(sys.executable, [sys.executable, *again], env)


def without_as_worker() -> dict[str, str]:
    """This process's environment for a server it launches (which re-executes nothing)."""
    return {k: v for k, v in os.environ.items() if k != AS_WORKER}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One launched server process (its own process group), logging to a file."""

    def __init__(
        self, name: str, template: str, fields: dict[str, str], env: dict[str, str], log_dir: Path
    ) -> None:
        self.name = name
        self.port = free_port()
        quoted = {k: shlex.quote(v) for k, v in fields.items()}
        self.command = template.format(port=self.port, **quoted)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}-{self.port}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            shlex.split(self.command),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.started = time.perf_counter()
        self.ready_s: float | None = None

    def wait_ready(self, timeout: float) -> None:
        """Poll GET /v1/models until 200; bounded by ``timeout`` and the process exiting."""
        deadline = time.perf_counter() + timeout
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while time.perf_counter() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.name} exited with {self.proc.returncode} before ready; "
                        f"see {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    if client.get(self.url + "/v1/models").status_code == 200:
                        self.ready_s = time.perf_counter() - self.started
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f}s; see {self.log_path}")

    def cpu_seconds(self) -> float | None:
        """User+system CPU of the server's process tree so far (needs psutil)."""
        try:
            import psutil

            root = psutil.Process(self.proc.pid)
            total = 0.0
            for p in [root, *root.children(recursive=True)]:
                t = p.cpu_times()
                total += t.user + t.system
            return total
        except Exception:
            return None

    def rss_mb(self) -> float | None:
        try:
            import psutil

            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
            return round(sum(p.memory_info().rss for p in procs) / 2**20, 1)
        except Exception:
            return None

    def log_tail(self, n: int = 2000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-n:].decode("utf-8", "replace")

    def stop(self, grace: float = 15.0) -> int | None:
        """SIGTERM the server's process group, then SIGKILL it after ``grace`` seconds."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=grace)
        self._log.close()
        return self.proc.returncode
