"""Speech: the real-time factor of transcription and of text to speech, for mlx-audio
in-process, the project's engines in-process and a gateway, on the same models and requests.

    python -m benchmarks.speech --stt-shape small --seconds 30 --concurrency 1,4 --requests 2

Transcription: a Whisper with random weights built for the run (worker/speech/stt_modelgen.py)
from `--stt-shape` (tiny: the tests' size; small; whisper-tiny: Whisper-tiny's dimensions),
scripted: greedy decoding says a fixed text (74 tokens for small and whisper-tiny; " hello
world" for tiny) whatever the audio, every layer still computed, so every source decodes the
same tokens. Each request: `--seconds` of tones and noise in a 16 kHz WAV, never sent before.
- `mlx-audio`: `mlx_audio.stt.load(path).generate(samples, ...)` in this process with the
  engine's arguments, on the WAV decoded beforehand; requests one after another;
- `engine`: worker/speech/transcribe.py's preprocessor (it decodes the WAV) and engine in
  this process, `c` requests in it: a new one as soon as one finishes;
- `gateway`: a gateway launched here, `c` client threads of the official openai SDK, each
  sending `audio.transcriptions.create(..., response_format="verbose_json")` as soon as its
  previous answer is back.
Text to speech (unless `--tasks transcription`): worker/speech/tts_modelgen.py's tiny random
Qwen3-TTS, which makes `--tts-frames` codec frames (12.5 a second of audio) a request; each
request a one-sentence text; `mlx-audio`: the model's own `generate`, one request after
another; `engine`: worker/speech/synthesize.py (sentences streamed in chunks, every running
request advanced a chunk a step, the audio encoded as WAV); `gateway`:
`audio.speech.create(..., response_format="wav")`.
Each source runs max(`--requests`, c) requests per repeat, after `--wait-idle`; the repeats
alternate the sources' order. Prints a JSON line of machine facts, one per repeat and a
median line per task and concurrency: `rtf` (the median request's wall time over its audio
seconds; lower is better), `audio_s_per_s` (audio seconds heard or made per second of
wall), tokens per request (Whisper's decoded tokens; codec frames), each source's ratio to
mlx-audio (medians of per-repeat ratios), whether every source produced the same tokens,
and the CPU other processes used meanwhile. Re-executes itself under the BLAS preload a
worker gets.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import wave
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import _cpu, _launch, _stats
from worker.speech.audio import decode_audio
from worker.speech.stt_modelgen import TinyWhisperSpec, build_tiny_whisper
from worker.speech.tts_modelgen import FRAME_RATE, TinyTTSSpec, build_tiny_tts

SOURCES = ("mlx-audio", "engine", "gateway")
BASELINE = "mlx-audio"
TASKS = ("transcription", "speech")
VOICE = "alloy"
RATE = 16000  # Whisper's sample rate: the WAVs need no resampling
# what the engine passes for temperature 0: Whisper's fallback schedule (mlx-audio's default)
TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
SCRIPT = (
    " The gateway starts one worker per model and talks to it over a socket. A request"
    " arrives, the prompt is tokenized, and tokens stream back as they are made."
)


def _whisper(state: int, heads: int, layers: int) -> TinyWhisperSpec:
    """Whisper's vocabulary and text context (448); the script spoken from 0 to 29 s."""
    return TinyWhisperSpec(
        n_state=state, n_head=heads, n_layer=layers, n_text_ctx=448, script=SCRIPT, script_end=29.0
    )


STT_SHAPES = {
    "tiny": TinyWhisperSpec(),  # the tests' model
    "small": _whisper(256, 4, 2),
    "whisper-tiny": _whisper(384, 6, 4),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.speech",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--stt-shape", choices=sorted(STT_SHAPES), default="small")
    p.add_argument("--seconds", type=float, default=30.0, help="of audio a transcription")
    p.add_argument("--tts-frames", type=int, default=64, help="codec frames a speech request")
    p.add_argument("--seed", type=int, default=0, help="of the built models' weights")
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--requests", type=int, default=2, help="per source, repeat and level")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--sources", default=",".join(SOURCES))
    p.add_argument("--ready-timeout", type=float, default=180.0)
    p.add_argument("--wait-idle", type=float, default=60.0, help="at most, for an idle machine")
    p.add_argument("--idle-threshold", type=float, default=30.0, help="%% of one core")
    args = p.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    except ValueError:
        p.error("--concurrency: comma-separated integers")
    args.tasks = [t for t in args.tasks.split(",") if t]
    args.sources = [s for s in args.sources.split(",") if s]
    if not args.concurrency or min(args.concurrency) < 1:
        p.error("--concurrency must be positive")
    if min(args.requests, args.repeats, args.tts_frames) < 1 or args.seconds <= 0:
        p.error("--requests, --repeats, --tts-frames and --seconds must be positive")
    if not args.tasks or not set(args.tasks) <= set(TASKS):
        p.error(f"--tasks: some of {', '.join(TASKS)}")
    if not args.sources or not set(args.sources) <= set(SOURCES):
        p.error(f"--sources: some of {', '.join(SOURCES)}")
    return args


# --- the workloads -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Clip:
    """A transcription's audio: the WAV sent, and its samples as the worker decodes them."""

    wav: bytes
    samples: np.ndarray
    seconds: float


def clips(seconds: float, first: int, count: int) -> list[Clip]:
    """Each its own three tones over low noise (seeded by its number)."""
    made = []
    t = np.arange(round(seconds * RATE)) / RATE
    for n in range(first, first + count):
        rng = np.random.default_rng(n)
        wave_ = sum(0.1 * np.sin(2 * np.pi * f * t) for f in rng.uniform(100, 2000, 3))
        wave_ = wave_ + 0.02 * rng.standard_normal(t.size)
        buffer = io.BytesIO()
        with wave.open(buffer, "wb") as out:
            out.setparams((1, 2, RATE, 0, "NONE", "not compressed"))
            out.writeframes((np.clip(wave_, -1, 1) * 32767).astype("<i2").tobytes())
        decoded = decode_audio(buffer.getvalue(), 3600.0, "wav")
        made.append(Clip(buffer.getvalue(), decoded.samples, decoded.duration))
    return made


def texts(first: int, count: int) -> list[str]:
    """One sentence each (the engine generates it in one piece, as mlx-audio does)."""
    line = "Request number {} reads this line aloud for the benchmark"
    return [line.format(n) for n in range(first, first + count)]


# --- the sources: each runs its items, `concurrency` at a time ----------------------------------


@dataclass(frozen=True, slots=True)
class Done:
    """What a request took and made."""

    latency: float  # seconds from the request's start (the engine: its add) to its end
    audio_s: float  # seconds of audio heard (transcription) or made (speech)
    tokens: int  # Whisper's decoded tokens; codec frames


Run = Callable[[Sequence[Any], int], list[Done]]


class MlxAudio:
    """mlx-audio's models called directly: Whisper's and the TTS model's own generate."""

    def __init__(self, task: str, path: Path) -> None:
        from mlx_audio.stt import load
        from mlx_audio.tts.utils import load_model

        self.model = (load if task == "transcription" else load_model)(path)
        self.task = task

    def run(self, items: Sequence[Any], concurrency: int) -> list[Done]:
        call = self.transcribe if self.task == "transcription" else self.speak
        done = []
        for item in items:  # one after another: mlx-audio batches neither
            start = time.perf_counter()
            audio_s, tokens = call(item)
            done.append(Done(time.perf_counter() - start, audio_s, tokens))
        return done

    def transcribe(self, clip: Clip) -> tuple[float, int]:
        result = self.model.generate(
            clip.samples,
            language=None,
            task="transcribe",
            initial_prompt=None,
            temperature=TEMPERATURES,
            word_timestamps=False,
        )
        return clip.seconds, sum(len(s["tokens"]) for s in result.segments or [])

    def speak(self, text: str) -> tuple[float, int]:
        results = list(self.model.generate(text, voice=VOICE, verbose=False))
        samples = sum(np.asarray(r.audio).size for r in results)
        frames = sum(int(getattr(r, "token_count", 0) or 0) for r in results)
        return samples / self.model.sample_rate, frames


class Engine:
    """The worker's preprocessor and engine of the task, driven as the worker drives them."""

    def __init__(self, task: str, path: Path) -> None:
        from shared.config import ModelConfig
        from worker.speech.synthesize import open_synthesizer
        from worker.speech.transcribe import open_transcriber

        config = ModelConfig(name=task, source=str(path))
        opened: Any = (open_transcriber if task == "transcription" else open_synthesizer)(
            config, path
        )
        self.engine, self.preprocess, _ = opened
        self.task = task
        self.ids = itertools.count()

    def prepare(self, item: Any) -> tuple[str, Any]:
        from shared.protocol import Add
        from shared.types import AudioPart, CanonicalRequest, RequestKind, SamplingParams

        rid = f"r{next(self.ids)}"
        if self.task == "transcription":
            request = CanonicalRequest(audio=AudioPart(item.wav, "wav"), timestamps=["segment"])
            add = Add(rid, RequestKind.TRANSCRIPTION, request, SamplingParams(temperature=0.0))
        else:
            request = CanonicalRequest(prompt=item, voice=VOICE, audio_format="wav")
            add = Add(rid, RequestKind.SPEECH, request, SamplingParams())
        return rid, self.preprocess(add)

    def run(self, items: Sequence[Any], concurrency: int) -> list[Done]:
        waiting = iter(items)
        started: dict[str, float] = {}
        done: list[Done] = []

        def admit() -> None:
            item = next(waiting, None)
            if item is None:
                return
            start = time.perf_counter()
            rid, prepared = self.prepare(item)
            started[rid] = start
            if self.engine.add(prepared) is not None:
                raise RuntimeError("the engine answered a request without running it")

        for _ in range(concurrency):
            admit()
        while self.engine.has_work:
            for out in self.engine.step():
                if out.error is not None:
                    raise RuntimeError(f"engine: {out.error}")
                if out.finish_reason is not None:
                    latency = time.perf_counter() - started.pop(out.request_id)
                    tokens = out.usage.completion_tokens if out.usage else 0
                    done.append(Done(latency, out.duration or 0.0, tokens))
                    admit()
        return done


class Gateway:
    """`concurrency` client threads of the official openai SDK, closed loop."""

    def __init__(self, task: str, url: str, served: str) -> None:
        self.task, self.url, self.served = task, url, served

    def transcribe(self, api: Any, clip: Clip) -> tuple[float, int]:
        answer = api.audio.transcriptions.create(
            model=self.served, file=("clip.wav", clip.wav), response_format="verbose_json"
        )
        return clip.seconds, sum(len(s.tokens) for s in answer.segments or [])

    def speak(self, api: Any, text: str) -> tuple[float, int]:
        answer = api.audio.speech.create(
            model=self.served, input=text, voice=VOICE, response_format="wav"
        )
        seconds = wav_seconds(answer.read())
        return seconds, round(seconds * FRAME_RATE)  # the frames the audio holds

    def run(self, items: Sequence[Any], concurrency: int) -> list[Done]:
        import openai

        call = self.transcribe if self.task == "transcription" else self.speak
        waiting = iter(items)
        lock = threading.Lock()
        done: list[Done] = []
        errors: list[BaseException] = []

        def client() -> None:
            api = openai.OpenAI(base_url=f"{self.url}/v1", api_key="-", max_retries=0, timeout=600)
            while not errors:
                with lock:
                    item = next(waiting, None)
                if item is None:
                    return
                start = time.perf_counter()
                try:
                    audio_s, tokens = call(api, item)
                except Exception as exc:
                    errors.append(exc)
                    return
                done.append(Done(time.perf_counter() - start, audio_s, tokens))

        threads = [threading.Thread(target=client) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError(f"gateway: {errors[0]!r}")
        return done


def wav_seconds(data: bytes) -> float:
    """A WAV's duration from its header's format and the bytes after its data chunk's header
    (a streamed WAV's sizes are placeholders)."""
    channels, rate = int.from_bytes(data[22:24], "little"), int.from_bytes(data[24:28], "little")
    width = int.from_bytes(data[34:36], "little") // 8
    start = data.find(b"data", 12) + 8
    return (len(data) - start) / (channels * width * rate)


@contextlib.contextmanager
def launched_gateway(model: Path, served: str, timeout: float) -> Iterator[_launch.Server]:
    """A gateway serving `model` as `served`, from a config of its defaults."""
    run_dir = _launch.gateway_run_dir()
    config = _launch.write_gateway_config(run_dir / "gw.toml", run_dir, str(model), served, {})
    fields = {"python": sys.executable, "config": str(config)}
    env = _launch.without_as_worker()
    server = _launch.Server("gateway", _launch.GATEWAY_COMMAND, fields, env, run_dir)
    try:
        server.wait_ready(timeout)
        _launch.wait_models_ready(server.url, timeout)
        yield server
    except RuntimeError:
        print(server.log_tail(), file=sys.stderr)
        raise
    finally:
        server.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


# --- measuring ---------------------------------------------------------------------------------


def measure(
    run: Run, items: Sequence[Any], concurrency: int, server_cpu: Callable[[], float | None]
) -> dict[str, Any]:
    """The requests' figures, and the CPU that processes other than this one and a launched
    gateway used meanwhile (% of one core): near 0 on a quiet machine."""
    before, own, server = _cpu.snapshot(), time.process_time(), server_cpu()
    start = time.perf_counter()
    done = run(items, concurrency)
    seconds = time.perf_counter() - start
    after, own = _cpu.snapshot(), time.process_time() - own
    server_after = server_cpu()
    server = server_after - server if server_after is not None and server is not None else 0.0
    busy = _cpu.busy_pct(before, after)
    other = None if busy is None else round(busy - 100 * (own + server) / seconds, 1)
    return {
        "rtf": round(statistics.median(d.latency / d.audio_s for d in done), 4),
        "audio_s_per_s": round(sum(d.audio_s for d in done) / seconds, 3),
        "tokens_per_request": round(sum(d.tokens for d in done) / len(done), 2),
        "audio_s_per_request": round(sum(d.audio_s for d in done) / len(done), 3),
        "seconds": round(seconds, 2),
        "other_cpu_pct": other,
        "steal_pct": _cpu.steal_pct(before, after),
    }


def median_line(
    task: str, concurrency: int, runs: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    line: dict[str, Any] = {"task": task, "concurrency": concurrency, "median": True}
    keys = ("rtf", "audio_s_per_s", "tokens_per_request", "audio_s_per_request")
    for source, results in runs.items():
        line[source] = {key: round(statistics.median(r[key] for r in results), 4) for key in keys}
        others = [r["other_cpu_pct"] for r in results if r["other_cpu_pct"] is not None]
        line[source]["other_cpu_pct"] = round(statistics.median(others), 1) if others else None
        if source != BASELINE and BASELINE in runs:
            pairs = list(zip(results, runs[BASELINE], strict=True))
            line[f"{source}/{BASELINE}"] = {
                key: round(statistics.median(r[key] / b[key] for r, b in pairs), 3)
                for key in ("rtf", "audio_s_per_s")
            }
    tokens = {r["tokens_per_request"] for results in runs.values() for r in results}
    line["same_tokens"] = len(tokens) == 1
    return line


def measure_task(
    task: str, args: argparse.Namespace, runs: dict[str, Run], server_cpu: Callable[[], Any]
) -> None:
    made = [0]  # items taken so far: each request's audio or text is new

    def take(count: int) -> list[Any]:
        first, made[0] = made[0], made[0] + count
        return clips(args.seconds, first, count) if task == "transcription" else texts(first, count)

    for run in runs.values():  # warm: first calls, the gateway's connections
        run(take(1), 1)
    for concurrency in args.concurrency:
        count = max(args.requests, concurrency)
        results: dict[str, list[dict[str, Any]]] = {source: [] for source in runs}
        for repeat in range(args.repeats):
            order = list(runs) if repeat % 2 == 0 else list(reversed(runs))
            line: dict[str, Any] = {"task": task, "concurrency": concurrency, "repeat": repeat}
            for source in order:
                items = take(count)
                waited = _cpu.wait_idle(args.wait_idle, args.idle_threshold, source)
                result = measure(runs[source], items, concurrency, server_cpu)
                results[source].append(result)
                line[source] = {**result, "idle_wait_s": waited["idle_wait_s"]}
            print(json.dumps(line), flush=True)
        print(json.dumps(median_line(task, concurrency, results)), flush=True)


def build(task: str, args: argparse.Namespace, into: str) -> Path:
    if task == "transcription":
        spec = STT_SHAPES[args.stt_shape]
        return build_tiny_whisper(into, args.seed, scripted=True, spec=spec)
    return build_tiny_tts(into, args.seed, spec=TinyTTSSpec(max_new_tokens=args.tts_frames))


def facts(paths: dict[str, Path], args: argparse.Namespace) -> dict[str, Any]:
    import mlx.core as mx

    from worker.modelgen import count_parameters

    machine = _stats.machine_info(os.environ.get("LD_PRELOAD"))
    machine.update(mlx_device=str(mx.default_device()), mlx_audio=metadata.version("mlx-audio"))
    models: dict[str, Any] = {t: {"parameters": count_parameters(p)} for t, p in paths.items()}
    if "transcription" in paths:
        spec = STT_SHAPES[args.stt_shape]
        fields = ("n_state", "n_head", "n_layer", "n_text_ctx")
        models["transcription"].update(
            shape=args.stt_shape, **{f: getattr(spec, f) for f in fields}
        )
    if "speech" in paths:
        models["speech"]["frames"] = args.tts_frames
    keys = ("tasks", "seconds", "concurrency", "requests", "repeats", "sources", "seed")
    return {"machine": machine, "models": models, "args": {k: getattr(args, k) for k in keys}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _launch.as_worker("benchmarks.speech", argv)
    os.environ["HF_HUB_OFFLINE"] = "1"  # local folders: nothing to fetch
    # a SIGTERM unwinds main, which stops the gateway it launched
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="bench-speech-") as built:
        paths = {task: build(task, args, f"{built}/{task}") for task in args.tasks}
        print(json.dumps(facts(paths, args)), flush=True)
        for task, path in paths.items():
            with contextlib.ExitStack() as stack:
                runs: dict[str, Run] = {}
                with contextlib.redirect_stdout(sys.stderr):  # mlx-audio's loaders print
                    if "mlx-audio" in args.sources:
                        runs["mlx-audio"] = MlxAudio(task, path).run
                    if "engine" in args.sources:
                        runs["engine"] = Engine(task, path).run
                server_cpu: Callable[[], float | None] = lambda: None  # noqa: E731
                if "gateway" in args.sources:
                    server = stack.enter_context(launched_gateway(path, task, args.ready_timeout))
                    runs["gateway"] = Gateway(task, server.url, task).run
                    server_cpu = server.cpu_seconds
                measure_task(task, args, runs, server_cpu)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
