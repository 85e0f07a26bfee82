"""The agent-session benchmark: its trace on a real tokenizer, its client and CLI against a
real gateway serving a tiny model, and its usage parsing, summaries and target check."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import pytest

from benchmarks import _launch, agent_session
from benchmarks._agent_client import Target, TurnRecord, run_sessions, usage_tokens
from benchmarks._agent_report import merge_runs, ratios, summarize_turns, target_check
from benchmarks._agent_trace import ChatTokens, build_trace, user_length
from benchmarks._client import make_client
from shared.blas import CUDNN_SDPA
from shared.config import load_config
from tests.gateway_proc import GatewayProc


@pytest.fixture(scope="module")
def tokens(chat_model: Path) -> ChatTokens:
    return ChatTokens(chat_model)


def test_trace_is_calibrated_and_grows_by_its_own_history(tokens: ChatTokens) -> None:
    trace = build_trace("t1", sessions=2, turns=4, system_tokens=300, tokens=tokens)
    assert 300 - 8 <= tokens.system(trace.system) <= 300
    for s in range(2):
        for t, text in enumerate(trace.users[s], 1):
            target = user_length(s, t, (100, 200))
            assert target - 8 <= tokens.text(text) <= target
    assert trace.users[0][0] != trace.users[1][0]

    replies: list[str] = []
    previous, lengths = None, []
    for turn in range(trace.turns):
        messages = trace.messages(0, replies)
        assert messages[0] == {"role": "system", "content": trace.system}
        assert messages[-1] == {"role": "user", "content": trace.users[0][turn]}
        if previous is not None:  # each request extends the last one with its reply
            assert messages[: len(previous)] == previous
            assert messages[len(previous)] == {"role": "assistant", "content": replies[-1]}
        lengths.append(tokens.conversation(messages))
        previous = messages
        replies.append(f"reply {turn}: the agent calls a tool")
    steps = [b - a for a, b in itertools.pairwise(lengths)]
    assert all(100 < step < 200 + 40 for step in steps), steps
    with pytest.raises(ValueError):
        trace.messages(0, replies)

    other = build_trace("t2", sessions=2, turns=4, system_tokens=300, tokens=tokens)
    assert other.system != trace.system  # a fresh system prompt per repeat
    assert other.system.split("]")[0] == "[t2"
    for a, b in zip(other.users[1], trace.users[1], strict=True):  # same targets, any tag
        assert abs(tokens.text(a) - tokens.text(b)) <= 8


def test_usage_fields_are_parsed_when_present() -> None:
    usage = {
        "prompt_tokens": 4200,
        "completion_tokens": 64,
        "total_tokens": 4264,
        "prompt_tokens_details": {"cached_tokens": 4096},
    }
    assert usage_tokens(usage) == (4200, 64, 4096)
    assert usage_tokens({"prompt_tokens": 10, "completion_tokens": 2}) == (10, 2, None)
    assert usage_tokens({"prompt_tokens": 1, "prompt_tokens_details": None}) == (1, None, None)


def _records(ttfts: list[list[float]]) -> list[list[TurnRecord]]:
    out = []
    for s, per_turn in enumerate(ttfts):
        session = []
        for t, ttft in enumerate(per_turn, 1):
            r = TurnRecord(s, t, start=0.0, end=ttft + 1.0, first=ttft)
            r.prompt_tokens, r.cached_tokens = 1000 * t, 900 * t if t > 1 else 0
            session.append(r)
        out.append(session)
    return out


def test_summaries_ratios_and_target() -> None:
    cache = summarize_turns(_records([[1.0, 0.1], [1.2, 0.3]]), turns=2)
    assert [r["ttft_ms"] for r in cache] == [1100.0, 200.0]
    assert cache[1]["cached_tokens"] == 1800
    failed = _records([[2.0, 1.0], [2.0, 1.0]])
    failed[1][1].error = "http_500: boom"
    nocache = summarize_turns(failed, turns=2)
    assert nocache[1]["failures"] == 1 and nocache[1]["errors"] == ["http_500: boom"]
    per_turn = {
        "gateway": merge_runs([cache]),
        "gateway-nocache": merge_runs([nocache]),
        "peer": merge_runs([cache]),
    }
    by_source = ratios(per_turn, "gateway")
    assert by_source == {"gateway-nocache": [1.82, 5.0], "peer": [1.0, 1.0]}
    lines = target_check(by_source, "gateway")
    assert lines[0].endswith("from turn 2: met") and lines[1].endswith("from turn 1: met")
    assert "NOT met (turn 2: 0.50x)" in target_check({"peer": [1.0, 0.5]}, "gateway")[0]


def test_gateway_config_turns_the_prefix_cache_off(tmp_path: Path) -> None:
    path = _launch.write_gateway_config(
        tmp_path / "gw.toml", tmp_path, "/models/m", "bench", {"prefix_cache": False}
    )
    config = load_config(path)
    assert [m.name for m in config.models] == ["bench"]
    assert config.models[0].engine.prefix_cache is False
    assert config.server.keys_file == f"{tmp_path}/keys.json"


def test_the_rows_source_is_the_gateway_on_its_own_batch(tmp_path: Path) -> None:
    engine = agent_session.GATEWAY_ENGINE["gateway-rows"]
    path = _launch.write_gateway_config(tmp_path / "gw.toml", tmp_path, "/m", "bench", engine)
    options = load_config(path).models[0].engine
    assert options.batcher == "rows" and options.prefix_cache is True
    assert "gateway-rows" not in agent_session.SOURCES  # measured when asked for


def test_the_whole_source_tokenizes_prompts_whole(tmp_path: Path) -> None:
    engine = agent_session.GATEWAY_ENGINE["gateway-rows-whole"]
    path = _launch.write_gateway_config(tmp_path / "gw.toml", tmp_path, "/m", "bench", engine)
    options = load_config(path).models[0].engine
    assert options.segment_tokens is False and options.prefix_cache is True


def test_two_sessions_of_two_turns_against_a_real_gateway(
    gateway: GatewayProc, tokens: ChatTokens
) -> None:
    trace = build_trace("e2e", sessions=2, turns=2, system_tokens=128, tokens=tokens)
    target = Target(gateway.base_url, "chat", max_tokens=8, ignore_eos=True)

    shares: list[dict[str, float]] = []

    async def go() -> list[list[TurnRecord]]:
        async with make_client(2, 60.0) as client:
            return await run_sessions(client, target, trace, shares=shares)

    records = asyncio.run(go())
    # each turn's account of the gateway's (the first from no request before it): its two
    # first tokens, where they waited
    assert len(shares) == 2, shares
    for share in shares:
        assert share["prefill_mean_ms"] > 0 and share["preprocess_mean_ms"] > 0
        assert share["gateway_ttft_mean_ms"] >= share["prefill_mean_ms"]
    for s, session in enumerate(records):
        assert [r.turn for r in session] == [1, 2]
        assert all(r.ok and r.ttft is not None and r.reply for r in session), session
        assert [r.completion_tokens for r in session] == [8, 8]
        # The server counts what the trace's tokenizer counts for the same history.
        history = trace.messages(s, [session[0].reply])
        assert session[0].prompt_tokens == tokens.conversation(trace.messages(s, []))
        assert session[1].prompt_tokens == tokens.conversation(history)
        assert all(r.cached_tokens is None or r.cached_tokens >= 0 for r in session)


def test_cli_against_a_running_url(gateway: GatewayProc, chat_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "agent.json"
    argv = ["--url", f"gateway={gateway.base_url}", "--model", "chat"]
    argv += ["--tokenizer", str(chat_model), "--turns", "2", "--system-tokens", "128"]
    argv += ["--max-tokens", "4", "--wait-idle", "0", "--warm-trace", "--out", str(out)]
    assert agent_session.main(argv) == 0
    variant = json.loads(out.read_text())["variants"][0]
    turns, fresh = variant["turns"]["gateway"], variant["fresh_turns"]["gateway"]
    for trace in (turns, fresh):
        assert [t["turn"] for t in trace] == [1, 2]
        assert all(t["failures"] == 0 and t["ttft_ms"] > 0 for t in trace)
        assert trace[1]["prompt_tokens"] > trace[0]["prompt_tokens"] + 100
    # The warm trace is other text of the same lengths: its system prompt is not a prefix
    # the measured trace's first turn finds cached.
    assert abs(fresh[0]["prompt_tokens"] - turns[0]["prompt_tokens"]) <= 8
    assert (turns[0]["cached_tokens"] or 0) < 32
    assert len(variant["runs"]["gateway"][0]["records"]) == 2
    assert len(variant["runs"]["gateway"][0]["worker_share"]) == 2
    # without the gateway's account: the same turns, no scrape between them
    argv = [a for a in argv if a != "--warm-trace"] + ["--no-account"]
    assert agent_session.main(argv) == 0
    run = json.loads(out.read_text())["variants"][0]["runs"]["gateway"][0]
    assert len(run["records"]) == 2 and run["worker_share"] == []


def test_url_sources_take_names_model_ids_and_ignore_eos() -> None:
    argv = ["--url", "gateway=http://127.0.0.1:8000", "--url", "mlx_lm=http://127.0.0.1:8080"]
    argv += ["--served-model", "gateway=bench", "--served-model", "fallback-id"]
    sources = agent_session.build_sources(agent_session.parse_args(argv))
    assert [(s.name, s.model_id, s.ignore_eos, s.command) for s in sources] == [
        ("gateway", "bench", True, None),
        ("mlx_lm", "fallback-id", False, None),
    ]
    (only,) = agent_session.build_sources(
        agent_session.parse_args(["--url", "http://127.0.0.1:9000/", "--model", "m"])
    )
    assert (only.name, only.url, only.model_id) == ("url", "http://127.0.0.1:9000", "m")
    with pytest.raises(ValueError, match="non-loopback"):
        agent_session.build_sources(agent_session.parse_args(["--url", "http://10.0.0.1:80"]))


def test_a_cudnn_source_launches_its_gateway_with_cudnns_attention(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers leave cuDNN's attention off unless their environment says otherwise."""
    argv = ["--model", str(tmp_path), "--sources", "gateway-rows-cudnn,gateway-rows"]
    args = agent_session.parse_args(argv)
    cudnn, plain = agent_session.build_sources(args)
    assert cudnn.engine == plain.engine and (cudnn.env, plain.env) == ({CUDNN_SDPA: "1"}, {})
    launched: list[dict[str, str]] = []

    def server(name: str, command: str, fields: object, env: dict[str, str], logs: Path) -> None:
        launched.append(env)
        raise OSError("not launched here")

    monkeypatch.setattr(_launch, "Server", server)
    for source in (cudnn, plain):
        out = agent_session.run_source(args, source, (None, None), {"A": "1"}, tmp_path)  # type: ignore[arg-type]
        assert "cannot launch" in out["error"]
    assert launched == [{"A": "1", CUDNN_SDPA: "1"}, {"A": "1"}]
