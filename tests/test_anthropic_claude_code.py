"""The Messages API as Claude Code uses it (pointed at this gateway by ANTHROPIC_BASE_URL):
what it sends with every request, translated without worker processes, and the context
overflow said in Anthropic's words, which it reads to recover."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from gateway.api.anthropic.errors import error_json
from gateway.api.anthropic.schemas import MessagesRequest
from gateway.api.anthropic.translate import messages_formatter, messages_request
from gateway.api.common import decode_body
from gateway.errors import GatewayError
from shared.types import (
    CanonicalRequest,
    ErrorCode,
    Message,
    OutputFormat,
    Reasoning,
    context_error,
)

USER = [{"role": "user", "content": "hi"}]
BILLING = "x-anthropic-billing-header: cc_version=2.1.160; cc_entrypoint=cli; cch={};"


def request(**fields: Any) -> MessagesRequest:
    body = {"model": "qwen", "max_tokens": 32000, "messages": USER, **fields}
    return decode_body(json.dumps(body).encode(), MessagesRequest)


def create(omit_hosted: bool = False, **fields: Any) -> CanonicalRequest:
    return messages_request(request(**fields), omit_hosted)[0]


def refused(**fields: Any) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        create(**fields)
    assert info.value.status == 400
    return info.value


def test_its_billing_block_is_left_out_and_its_blocks_do_not_run_together() -> None:
    # the billing block's checksum changes with every request: kept, it would end at its
    # first line the prefix every turn shares
    system = [
        {"type": "text", "text": BILLING.format("fa690")},
        {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "You are an interactive CLI tool."},
    ]
    first = create(system=system).messages[0]
    assert first == Message("system", "You are Claude Code.\nYou are an interactive CLI tool.")
    system[0]["text"] = BILLING.format("01b2c")
    assert create(system=system).messages[0] == first


def test_system_messages_in_the_conversation_join_the_system_prompt() -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "system", "content": [{"type": "text", "text": "Agents: explore, plan."}]},
        {"role": "assistant", "content": "Hello."},
        {"role": "system", "content": "Skills: pdf."},
        {"role": "user", "content": "go"},
    ]
    canonical = create(system="Be brief.", messages=messages)
    assert [m.role for m in canonical.messages] == ["system", "user", "assistant", "user"]
    assert canonical.messages[0].content == "Be brief.\n\nAgents: explore, plan.\n\nSkills: pdf."
    bad = [*messages[:1], {"role": "system", "content": [{"type": "image", "source": {}}]}]
    assert refused(messages=bad).param == "messages[1].content[0].type"


def test_adaptive_thinking_is_the_model_s_to_decide() -> None:
    # sent with every request, whatever the model: one that thinks may, one that does not
    # answers (it asks for no capability)
    req = request(thinking={"type": "adaptive", "display": "omitted"})
    canonical = messages_request(req)[0]
    assert canonical.reasoning == Reasoning(advisory=True)  # the deployment's default
    assert "reasoning" not in canonical.needs()
    thinker = messages_formatter(req, canonical, model_thinks=True)
    assert (thinker.text_first, thinker.show_thinking) == (False, False)
    assert messages_formatter(req, canonical).text_first


def _thinking_turns() -> list[dict[str, Any]]:
    turns: list[dict[str, Any]] = []
    for i in range(3):
        turns.append({"role": "user", "content": f"q{i}"})
        content = [{"type": "thinking", "thinking": f"t{i}", "signature": ""}]
        turns.append({"role": "assistant", "content": [*content, {"type": "text", "text": "a"}]})
    return [*turns, {"role": "user", "content": "next"}]


@pytest.mark.parametrize(
    ("keep", "kept"),
    [
        ("all", ["t0", "t1", "t2"]),
        ({"type": "thinking_turns", "value": 2}, [None, "t1", "t2"]),
        (None, [None, None, "t2"]),  # Anthropic's default: the last turn's
    ],
)
def test_context_management_clears_the_older_turns_thinking(
    keep: Any, kept: list[str | None]
) -> None:
    edit: dict[str, Any] = {"type": "clear_thinking_20251015"}
    if keep is not None:
        edit["keep"] = keep
    canonical = create(messages=_thinking_turns(), context_management={"edits": [edit]})
    assert [m.reasoning for m in canonical.messages if m.role == "assistant"] == kept


def test_a_tool_loop_is_one_turn_whose_thinking_is_kept_whole() -> None:
    def step(i: int) -> list[dict[str, Any]]:
        use = {"type": "tool_use", "id": f"c{i}", "name": "Read", "input": {}}
        thought = {"type": "thinking", "thinking": f"step {i}", "signature": ""}
        result = {"type": "tool_result", "tool_use_id": f"c{i}", "content": "ok"}
        return [
            {"role": "assistant", "content": [thought, use]},
            {"role": "user", "content": [result]},
        ]

    messages = [*_thinking_turns()[:2], {"role": "user", "content": "go"}, *step(1), *step(2)]
    edits = {"edits": [{"type": "clear_thinking_20251015"}]}  # keep the last turn's
    canonical = create(messages=messages, context_management=edits)
    thoughts = [m.reasoning for m in canonical.messages if m.role == "assistant"]
    assert thoughts == [None, "step 1", "step 2"]  # the loop's steps are the last turn


def test_a_system_message_last_asks_for_a_new_turn_not_a_continuation() -> None:
    messages = [*USER, {"role": "assistant", "content": "Sure"}, {"role": "system", "content": "x"}]
    canonical = create(messages=messages)
    assert canonical.add_generation_prompt and canonical.chat_template_kwargs == {}
    assert not create(messages=messages[:2]).add_generation_prompt  # a prefill


def test_context_edits_not_served_are_named() -> None:
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 1}}
    error = refused(context_management={"edits": [edit]})
    assert error.param == "context_management.edits[0].type"
    keep = {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 0}}
    assert refused(context_management={"edits": [keep]}).param is not None


def test_output_config_effort_and_format() -> None:
    # effort is guidance: a template that takes none goes without (worker: Preprocessor)
    canonical = create(output_config={"effort": "max"}, thinking={"type": "adaptive"})
    assert canonical.reasoning == Reasoning(effort="high", advisory=True)
    assert "reasoning" not in canonical.needs()
    budget = {"type": "enabled", "budget_tokens": 1024}
    thinking = create(output_config={"effort": "low"}, thinking=budget).reasoning
    assert thinking == Reasoning(True, 1024, "low", advisory=True)
    assert thinking is not None and thinking.required  # a budget asks for thinking
    schema = {"type": "object", "properties": {"title": {"type": "string"}}}
    fmt = create(output_config={"format": {"type": "json_schema", "schema": schema}})
    assert fmt.response_format is not None
    assert fmt.response_format.type is OutputFormat.JSON_SCHEMA
    assert (fmt.response_format.schema, fmt.response_format.strict) == (schema, True)
    assert fmt.response_format.param == "output_config.format"
    error = refused(output_config={"format": {"type": "json_object"}})
    assert error.param == "output_config.format"
    assert refused(output_config={"effort": "extreme"}).param == "output_config.effort"


def test_server_tools_are_refused_or_left_out_as_the_server_says() -> None:
    tools = [
        {"name": "Read", "input_schema": {"type": "object"}},
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 8},
    ]
    error = refused(tools=tools)
    assert error.param == "tools[1].type" and 'server.hosted_tools = "omit"' in error.message
    assert [tool.name for tool in create(omit_hosted=True, tools=tools).tools] == ["Read"]


def _error_message(error: GatewayError) -> str:
    message: str = msgspec.json.decode(error_json(error))["error"]["message"]
    return message


def test_a_context_overflow_is_said_in_anthropic_s_words() -> None:
    # Claude Code reads these: it retries with a smaller max_tokens on the first, and
    # compacts its conversation on the second
    def said(limit: int, prompt: int, asked: int | None) -> str:
        error = GatewayError.from_request_error(context_error(limit, prompt, asked, "messages"))
        return _error_message(error)

    assert said(32768, 1200, 32000) == (
        "input length and `max_tokens` exceed context limit: 1200 + 32000 > 32768, decrease "
        "input length or `max_tokens` and try again"
    )
    assert said(32768, 40000, 32000) == "prompt is too long: 40000 tokens > 32768 maximum"
    assert said(32768, 40000, None) == "prompt is too long: 40000 tokens > 32768 maximum"
    other = GatewayError(ErrorCode.INVALID_REQUEST, "bad")
    assert _error_message(other) == "bad"  # only a context overflow is reworded
