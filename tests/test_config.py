"""load_config: defaults, TOML files, validation and environment overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.config import (
    DEMO_SOURCE,
    MINILM_SOURCE,
    VISION_DEMO_SOURCE,
    Config,
    ConfigError,
    EngineOptions,
    ModelConfig,
    ModelKind,
    ServerConfig,
    load_config,
    parse_duration,
)
from shared.modelinfo import kind_of, kind_served

TWO_MODELS = """
[server]
host = "0.0.0.0"
port = 9001
blas = "off"

[[models]]
name = "qwen"
source = "mlx-community/Qwen3-0.6B-4bit"
aliases = ["small", "default"]
revision = "main"

[models.engine]
max_running = 8
max_waiting = 4
prefill_step_size = 256
max_context = 4096
default_max_tokens = 512

[[models]]
name = "local"
source = "/models/local"
preload = false
"""


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("CONFIG", "HOST", "PORT", "RUN_DIR", "BLAS"):
        monkeypatch.delenv(f"MLX_GATEWAY_{name}", raising=False)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    return path


def test_no_file_gives_the_demo_model_and_minilm_for_embeddings() -> None:
    config = load_config(None)
    assert config.server == ServerConfig()
    names = [m.name for m in config.models]
    assert names == [
        "demo",
        "all-minilm-l6-v2",
        "demo-vision-random",
        "demo-transcription-random",
        "demo-speech-random",
    ]
    demo, minilm, vision, stt, tts = config.models
    assert kind_of(stt) is ModelKind.TRANSCRIPTION and stt.is_demo and not stt.preload
    assert kind_of(tts) is ModelKind.SPEECH and tts.is_demo and not tts.preload
    assert vision.source == VISION_DEMO_SOURCE and vision.is_demo and not vision.preload
    assert kind_of(vision) is ModelKind.VISION and vision.aliases == ["vision"]
    assert demo.source == DEMO_SOURCE
    assert demo.is_demo
    assert demo.aliases == ["default"]
    assert kind_of(demo) is ModelKind.LLM
    assert demo.engine == EngineOptions()
    assert minilm.source == MINILM_SOURCE and minilm.aliases == ["embeddings"]
    assert kind_of(minilm) is ModelKind.EMBEDDING and not minilm.preload


def test_kind_is_what_the_files_say_unless_set(tmp_path: Path) -> None:
    def model(kind: ModelKind | None = None, **files: str) -> ModelConfig:
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        for name, text in files.items():
            (folder / name.replace("_json", ".json")).write_text(text)
        return ModelConfig(name="m", source=str(folder), kind=kind)

    assert kind_of(model(config_json='{"model_type": "llama"}')) is ModelKind.LLM
    assert kind_of(model(config_json='{"model_type": "bert"}')) is ModelKind.EMBEDDING
    assert kind_of(model(config_json='{"model_type": "xlm-roberta"}')) is ModelKind.EMBEDDING
    assert kind_of(model(config_json='{"model_type": "qwen3"}', modules_json="[]")) is (
        ModelKind.EMBEDDING  # a sentence-transformers folder
    )
    assert kind_of(model(ModelKind.LLM, config_json='{"model_type": "bert"}')) is ModelKind.LLM
    hub = ModelConfig(name="h", source="org/not-downloaded")
    assert kind_of(hub) is ModelKind.LLM


def test_config_env_var_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_GATEWAY_CONFIG", str(write(tmp_path, TWO_MODELS)))
    assert [m.name for m in load_config().models] == ["qwen", "local"]


def test_two_models_with_aliases_and_engine_options(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, TWO_MODELS))
    assert config.server.host == "0.0.0.0"
    assert config.server.port == 9001
    assert config.server.blas == "off"
    assert config.server.log_level == "info"  # untouched default
    qwen, local = config.models
    assert qwen == ModelConfig(
        name="qwen",
        source="mlx-community/Qwen3-0.6B-4bit",
        aliases=["small", "default"],
        revision="main",
        engine=EngineOptions(
            max_running=8,
            max_waiting=4,
            prefill_step_size=256,
            max_context=4096,
            default_max_tokens=512,
        ),
    )
    assert qwen.engine.prefill_batch_size == 8  # default kept
    assert not qwen.is_demo
    assert local.preload is False
    assert local.aliases == []
    assert local.engine == EngineOptions()


def test_empty_file_gives_the_demo_model(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "[server]\nport = 8123\n"))
    assert config.server.port == 8123
    assert [m.source for m in config.models][:3] == [DEMO_SOURCE, MINILM_SOURCE, VISION_DEMO_SOURCE]


@pytest.mark.parametrize(
    "models",
    [
        '[[models]]\nname = "a"\nsource = "x"\naliases = ["b"]\n'
        '[[models]]\nname = "b"\nsource = "y"\n',
        '[[models]]\nname = "a"\nsource = "x"\naliases = ["c"]\n'
        '[[models]]\nname = "b"\nsource = "y"\naliases = ["c"]\n',
        '[[models]]\nname = "a"\nsource = "x"\n[[models]]\nname = "a"\nsource = "y"\n',
        '[[models]]\nname = "a"\nsource = "x"\naliases = ["a"]\n',
    ],
)
def test_duplicate_name_or_alias(tmp_path: Path, models: str) -> None:
    with pytest.raises(ConfigError, match="used twice"):
        load_config(write(tmp_path, models))


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[server]\nprot = 1\n", "prot"),
        ("colour = 1\n", "colour"),
        ('[[models]]\nname = "a"\nsource = "x"\nalias = ["b"]\n', "alias"),
        ('[[models]]\nname = "a"\nsource = "x"\n[models.engine]\nmax_batch = 3\n', "max_batch"),
    ],
)
def test_unknown_key_is_named(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        load_config(write(tmp_path, text))


def test_wrong_type_and_missing_required(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="port"):
        load_config(write(tmp_path, '[server]\nport = "high"\n'))
    with pytest.raises(ConfigError, match="source"):
        load_config(write(tmp_path, '[[models]]\nname = "a"\n'))


def test_invalid_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[server\nport = 1\n"))


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="not found") as info:
        load_config(missing)
    assert str(missing) in str(info.value)


@pytest.mark.parametrize(
    "option",
    [
        "max_running = 0",
        "prefill_step_size = 0",
        "max_waiting = -1",
        "max_prefill_tokens = 0",
        "prefix_cache_gb = -1",
        "prefix_cache_gb = nan",
        "kv_memory_gb = 0",
        "kv_memory_gb = inf",
        "buffer_cache_gb = 0",
    ],
)
def test_bad_engine_options(tmp_path: Path, option: str) -> None:
    text = f'[[models]]\nname = "a"\nsource = "x"\n[models.engine]\n{option}\n'
    key = option.split(" =")[0]
    with pytest.raises(
        ConfigError,
        match=rf"engine\.{key} (must be at least 1|must not be "
        r"negative|must be a finite number >= 0|must be positive)",
    ):
        load_config(write(tmp_path, text))


@pytest.mark.parametrize("option", ["prefix_cache = 1", "prefix_cache_gb = true"])
def test_engine_options_of_the_wrong_type(tmp_path: Path, option: str) -> None:
    text = f'[[models]]\nname = "a"\nsource = "x"\n[models.engine]\n{option}\n'
    with pytest.raises(ConfigError, match=option.split(" =")[0]):
        load_config(write(tmp_path, text))


def test_the_old_admission_settings_are_named_in_the_error(tmp_path: Path) -> None:
    text = '[[models]]\nname = "a"\nsource = "x"\n[models.engine]\nadmission_gap_ms = 20\n'
    with pytest.raises(ConfigError, match="admission_gap_ms"):
        load_config(write(tmp_path, text))


def test_zero_prefill_batch_size_is_rejected(tmp_path: Path) -> None:
    text = '[[models]]\nname = "a"\nsource = "x"\n[models.engine]\nprefill_batch_size = 0\n'
    with pytest.raises(ConfigError):
        load_config(write(tmp_path, text))


def test_env_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_GATEWAY_PORT", "8765")
    monkeypatch.setenv("MLX_GATEWAY_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("MLX_GATEWAY_HOST", "::1")
    config = load_config(None)
    assert config.server.port == 8765
    assert config.server.run_dir == str(tmp_path / "run")
    assert config.server.host == "::1"
    # the environment beats the file
    file_config = load_config(write(tmp_path, TWO_MODELS))
    assert file_config.server.port == 8765
    assert file_config.server.host == "::1"
    assert file_config.server.blas == "off"  # not overridden
    assert [m.name for m in file_config.models] == ["qwen", "local"]


def test_env_overrides_are_not_sticky(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_GATEWAY_PORT", "8765")
    assert load_config(None).server.port == 8765
    monkeypatch.delenv("MLX_GATEWAY_PORT")
    assert load_config(None).server.port == 8000


def test_bad_port_env_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLX_GATEWAY_PORT", "eighty")
    with pytest.raises(ConfigError):
        load_config(None)


def test_with_defaults_keeps_configured_models() -> None:
    model = ModelConfig(name="m", source="/x")
    assert Config(models=[model]).with_defaults().models == [model]


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (30, 30.0),
        (1.5, 1.5),
        ("30", 30.0),
        ("90s", 90.0),
        ("30m", 1800.0),
        ("2h", 7200.0),
        ("1d", 86400.0),
        ("500ms", 0.5),
        ("-1", -1.0),
        (-1, -1.0),
        (0, 0.0),
        (" 5M ", 300.0),
    ],
)
def test_durations(value: float | str, seconds: float) -> None:
    assert parse_duration(value) == seconds


@pytest.mark.parametrize(
    "value", ["soon", "5 minutes", "m", "", True, "inf", "nan", "1e400", 1e12, "-1e12"]
)
def test_bad_durations_are_named(value: object) -> None:
    with pytest.raises(ConfigError, match="keep_alive"):
        parse_duration(value, "keep_alive")  # type: ignore[arg-type]


@pytest.mark.parametrize(("option", "default"), [("fused_cpu_ops", True), ("segment_tokens", True)])
def test_bool_engine_options_take_a_bool_only(tmp_path: Path, option: str, default: bool) -> None:
    head = '[[models]]\nname = "a"\nsource = "x"\n[models.engine]\n'
    assert getattr(load_config(write(tmp_path, head)).models[0].engine, option) is default
    off = load_config(write(tmp_path, head + f"{option} = false\n"))
    assert getattr(off.models[0].engine, option) is False
    for wrong in ('"yes"', "1"):
        with pytest.raises(ConfigError, match=option):
            load_config(write(tmp_path, head + f"{option} = {wrong}\n"))


def test_join_settle_steps_is_for_the_rows_batch(tmp_path: Path) -> None:
    head = '[[models]]\nname = "a"\nsource = "x"\n[models.engine]\n'
    assert load_config(write(tmp_path, head)).models[0].engine.join_settle_steps == 0
    two = load_config(write(tmp_path, head + "join_settle_steps = 2\n"))
    assert two.models[0].engine.join_settle_steps == 2
    with pytest.raises(ConfigError, match="join_settle_steps must not be negative"):
        load_config(write(tmp_path, head + "join_settle_steps = -1\n"))
    with pytest.raises(ConfigError, match="join_settle_steps applies to the rows batch"):
        load_config(write(tmp_path, head + 'batcher = "mlx_lm"\njoin_settle_steps = 1\n'))


def test_batcher_is_auto_mlx_lm_or_rows(tmp_path: Path) -> None:
    head = '[[models]]\nname = "a"\nsource = "x"\n[models.engine]\n'
    assert load_config(write(tmp_path, head)).models[0].engine.batcher == "auto"
    for name in ("rows", "mlx_lm"):
        chosen = load_config(write(tmp_path, head + f'batcher = "{name}"\n'))
        assert chosen.models[0].engine.batcher == name
    with pytest.raises(ConfigError, match="batcher"):
        load_config(write(tmp_path, head + 'batcher = "vllm"\n'))


def test_decode_step_is_the_models_or_the_compiled_one_in_the_rows_batch(tmp_path: Path) -> None:
    head = '[[models]]\nname = "a"\nsource = "x"\n[models.engine]\n'
    assert load_config(write(tmp_path, head)).models[0].engine.decode_step == "auto"
    # "auto" follows whichever batch the model gets, BatchGenerator's included
    auto = load_config(write(tmp_path, head + 'batcher = "mlx_lm"\n'))
    assert auto.models[0].engine.decode_step == "auto"
    chosen = load_config(write(tmp_path, head + 'decode_step = "compiled"\n'))
    assert chosen.models[0].engine.decode_step == "compiled"
    with pytest.raises(ConfigError, match="decode_step"):
        load_config(write(tmp_path, head + 'decode_step = "fast"\n'))
    with pytest.raises(ConfigError, match="decode_step = 'compiled' runs in the rows batch"):
        load_config(write(tmp_path, head + 'batcher = "mlx_lm"\ndecode_step = "compiled"\n'))


# Options taken only where what they choose runs: (option, its default, the values it takes,
# values it refuses, settings that leave it nothing to choose, the refusal's words)
WHERE_IT_RUNS = [
    (
        "decode_attention",
        "auto",
        ("kernel", "mlx"),
        ("1",),
        ('batcher = "mlx_lm"', 'decode_step = "model"'),
        "applies to the compiled step",
    ),
    (
        "prefill_attention",
        "auto",
        ("kernel", "mlx"),
        ("1", '"flash"'),
        ('batcher = "mlx_lm"', 'first_token = "step"'),
        "applies to the rows batch",
    ),
    (
        "first_token_read",
        "pipelined",
        ("early",),
        ('"soon"',),
        ('batcher = "mlx_lm"', 'first_token = "step"'),
        "applies to the rows batch",
    ),
    (
        "decode_projections",
        "separate",
        ("stacked",),
        ('"fused"',),
        ('batcher = "mlx_lm"', 'decode_step = "model"'),
        "applies to the compiled step",
    ),
]


@pytest.mark.parametrize(("option", "default", "values", "wrong", "others", "words"), WHERE_IT_RUNS)
def test_an_option_is_taken_only_where_what_it_chooses_runs(
    tmp_path: Path,
    option: str,
    default: str,
    values: tuple[str, ...],
    wrong: tuple[str, ...],
    others: tuple[str, ...],
    words: str,
) -> None:
    head = '[[models]]\nname = "a"\nsource = "x"\n[models.engine]\n'
    assert getattr(load_config(write(tmp_path, head)).models[0].engine, option) == default
    for value in values:
        chosen = load_config(write(tmp_path, head + f'{option} = "{value}"\n'))
        assert getattr(chosen.models[0].engine, option) == value
    for bad in wrong:
        with pytest.raises(ConfigError, match=option):
            load_config(write(tmp_path, head + f"{option} = {bad}\n"))
    for other in others:
        with pytest.raises(ConfigError, match=f"{option} {words}"):
            load_config(write(tmp_path, head + f'{other}\n{option} = "{values[0]}"\n'))


def test_a_model_without_kind_is_what_its_worker_served() -> None:
    hub = ModelConfig(name="h", source="BAAI/bge-small-en-v1.5")  # a hub id: files unknown
    assert kind_served(hub, None) is ModelKind.LLM
    assert kind_served(hub, ["embeddings"]) is ModelKind.EMBEDDING
    assert kind_served(hub, ["embeddings", "rerank"]) is ModelKind.EMBEDDING
    assert kind_served(hub, ["rerank"]) is ModelKind.RERANK
    assert kind_served(hub, ["chat", "completion"]) is ModelKind.LLM
    configured = ModelConfig(name="c", source="x/y", kind=ModelKind.RERANK)
    assert kind_served(configured, ["chat", "completion"]) is ModelKind.RERANK  # as configured


def test_several_machines_and_shards_are_checked(tmp_path: Path) -> None:
    def load(server: str, model: str) -> Config:
        text = f'[server]\n{server}\n\n[[models]]\nname = "m"\nsource = "/m"\n{model}\n'
        return load_config(str(write(tmp_path, text)))

    config = load('workers_listen = "0.0.0.0:7380"', 'placement = "remote"')
    assert config.server.workers_listen == "0.0.0.0:7380"
    assert config.models[0].placement == "remote"
    assert load("", "shards = 2").models[0].shards == 2
    hosts = '\n[models.hosts]\nranks = ["127.0.0.1", "me@127.0.0.1"]\nssh = ["ssh", "-p", "22"]'
    spread = load("", "shards = 2" + hosts).models[0].hosts
    assert spread.ranks == ["127.0.0.1", "me@127.0.0.1"] and spread.ssh == ["ssh", "-p", "22"]
    assert spread.ring_port == 32323 and spread.python is None
    for server, model, error in [
        ("", "shards = 1" + hosts, "hosts.ranks is for a sharded model"),
        ("", "shards = 3" + hosts, "names 2 machines for shards = 3"),
        ("", 'shards = 2\n[models.hosts]\nranks = ["a", "b"]', "needs an IPv4 address"),
        ("", "shards = 2\n[models.hosts]\nlanes = 2", "lanes"),
        ('workers_listen = "7380"', "", "not HOST:PORT"),
        ('workers_listen = "host:99999"', "", "not HOST:PORT"),
        ("", 'placement = "elsewhere"', "placement"),
        ("", "shards = 0", "shards must be between 1 and 16"),
        ("", "shards = 100000", "shards must be between 1 and 16"),
        ("", 'shards = 2\nplacement = "remote"', "runs on this machine"),
        ("", 'shards = 2\nkind = "embedding"', "only text models"),
    ]:
        with pytest.raises(ConfigError, match=error):
            load(server, model)


def test_models_over_several_machines_keep_their_ring_ports_apart(tmp_path: Path) -> None:
    model = (
        '[[models]]\nname = "{name}"\nsource = "/m"\nshards = 2\n{extra}'
        '[models.hosts]\nranks = ["127.0.0.1", "me@127.0.0.1"]\nring_port = {port}\n'
    )
    two = model.format(name="a", port=40000, extra="") + model.format(
        name="b", port=40003, extra=""
    )
    with pytest.raises(ConfigError, match=r"'a' and 'b': their hosts\.ring_port ranges overlap"):
        load_config(write(tmp_path, two))
    apart = model.format(name="a", port=40000, extra="") + model.format(
        name="b", port=40004, extra=""
    )
    assert [m.hosts.ring_port for m in load_config(write(tmp_path, apart)).models] == [40000, 40004]
    piped = model.format(
        name="p", port=40000, extra='sharding = "pipeline"\n[models.engine]\nbatcher = "mlx_lm"\n'
    )
    with pytest.raises(ConfigError, match="'pipeline' runs on the rows batch"):
        load_config(write(tmp_path, piped))


def test_prefill_shapes_is_auto_by_default_and_buckets_need_the_rows_batch(
    tmp_path: Path,
) -> None:
    head = '[[models]]\nname = "a"\nsource = "x"\n[models.engine]\n'
    assert load_config(write(tmp_path, head)).models[0].engine.prefill_shapes == "auto"
    for name in ("exact", "buckets"):
        chosen = load_config(write(tmp_path, head + f'prefill_shapes = "{name}"\n'))
        assert chosen.models[0].engine.prefill_shapes == name
    for bad in ('"padded"', "1", "true"):
        with pytest.raises(ConfigError, match="prefill_shapes"):
            load_config(write(tmp_path, head + f"prefill_shapes = {bad}\n"))
    with pytest.raises(ConfigError, match="prefill_shapes applies to the rows batch"):
        load_config(write(tmp_path, head + 'batcher = "mlx_lm"\nprefill_shapes = "buckets"\n'))
    auto = load_config(write(tmp_path, head + 'batcher = "mlx_lm"\n'))
    assert auto.models[0].engine.prefill_shapes == "auto"  # follows whichever batch it gets


def test_first_token_is_auto_by_default_and_prefill_needs_the_rows_batch(tmp_path: Path) -> None:
    head = '[[models]]\nname = "a"\nsource = "x"\n[models.engine]\n'
    assert load_config(write(tmp_path, head)).models[0].engine.first_token == "auto"
    for name in ("prefill", "step"):
        chosen = load_config(write(tmp_path, head + f'first_token = "{name}"\n'))
        assert chosen.models[0].engine.first_token == name
    with pytest.raises(ConfigError, match="first_token"):
        load_config(write(tmp_path, head + 'first_token = "decode"\n'))
    with pytest.raises(ConfigError, match="first_token = 'prefill' applies to the rows batch"):
        load_config(write(tmp_path, head + 'batcher = "mlx_lm"\nfirst_token = "prefill"\n'))
    step = load_config(write(tmp_path, head + 'batcher = "mlx_lm"\nfirst_token = "step"\n'))
    assert step.models[0].engine.first_token == "step"  # mlx-lm's way: BatchGenerator's own


def test_strict_tools_are_enforced_by_default_or_best_effort(tmp_path: Path) -> None:
    head = '[[models]]\nname = "a"\nsource = "x"\n[models.engine]\n'
    assert load_config(write(tmp_path, head)).models[0].engine.strict_tools == "enforce"
    lenient = load_config(write(tmp_path, head + 'strict_tools = "best_effort"\n'))
    assert lenient.models[0].engine.strict_tools == "best_effort"
    with pytest.raises(ConfigError, match="strict_tools"):
        load_config(write(tmp_path, head + 'strict_tools = "ignore"\n'))
