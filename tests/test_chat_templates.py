"""Generated models' tool-call and thinking templates, as mlx-lm loads, renders and parses them."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import jinja2
import pytest
from mlx_lm import load as mlx_load
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_tokenizer

from shared.config import Config
from worker import chat_templates, modelgen
from worker.chat_templates import CHAT_TEMPLATE, chat_template
from worker.modelgen import DEMO_SPEC, TinyModelSpec, build_tiny_model

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "the city's name"},
                "days": {"type": "integer"},
                "scale": {"type": "number"},
                "hourly": {"type": "boolean"},
                "units": {"type": "string", "enum": ["c", "f"]},
                "where": {"type": "object"},
                "fields": {"type": "array"},
            },
            "required": ["city"],
        },
    },
}
TOOLS = [WEATHER]
# Arguments of every JSON type, including a string with newlines and JSON-looking text.
ARGS: dict[str, Any] = {
    "city": "Paris",
    "days": 3,
    "scale": 2.5,
    "hourly": False,
    "units": "c",
    "where": {"lat": 48.85, "tags": ["a", "b"]},
    "fields": [1, "two", None],
}
ODD_STRING = {"city": 'two\nlines, "quoted" {"not": "json"}'}
PARSERS = {"hermes": "json_tools", "qwen3_coder": "qwen3_coder"}
# sha256 of the plain template every generated model had before tools and thinking.
PLAIN_SHA = "8f8fa469a62dc795836994d16e40c7f407b9ce78bf4c4fcb0ca9978ce2aa230e"


@pytest.fixture(scope="module")
def hermes(hermes_model_dir: Path) -> TokenizerWrapper:
    return load_tokenizer(hermes_model_dir)


@pytest.fixture(scope="module")
def coder(coder_model_dir: Path) -> TokenizerWrapper:
    return load_tokenizer(coder_model_dir)


@pytest.fixture(params=["hermes", "qwen3_coder"])
def tok(request: pytest.FixtureRequest) -> TokenizerWrapper:
    name = "hermes" if request.param == "hermes" else "coder"
    wrapper: TokenizerWrapper = request.getfixturevalue(name)
    return wrapper


def call(name: str, arguments: Any, call_id: str = "call_1") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def render(tok: TokenizerWrapper, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    text = tok.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=False, **kwargs
    )
    assert isinstance(text, str)
    return text


def call_blocks(text: str) -> list[str]:
    """What mlx-lm hands its tool parser: the text between each call's markers, after the
    system turn (whose instructions show the markers too)."""
    assert text.startswith("<|im_start|>system\n")
    history = text[text.index("<|im_end|>") :]
    return re.findall(r"<tool_call>(.*?)</tool_call>", history, re.DOTALL)


def test_mlx_lm_load_infers_parser_and_thinking(hermes_model_dir: Path, coder_model_dir: Path):
    for path, parser in ((hermes_model_dir, "json_tools"), (coder_model_dir, "qwen3_coder")):
        model, tok = mlx_load(str(path))[:2]
        assert tok.has_tool_calling and tok.has_thinking
        assert tok.tool_parser.__module__ == f"mlx_lm.tool_parsers.{parser}"
        assert (tok.tool_call_start, tok.tool_call_end) == ("<tool_call>", "</tool_call>")
        assert (tok.think_start, tok.think_end) == ("<think>", "</think>")
        assert len(tok.tool_call_start_tokens) == len(tok.tool_call_end_tokens) == 1
        assert tok.think_start_id is not None and tok.think_end_id is not None
        assert len(tok) == model.args.vocab_size


def test_markers_are_text_tokens(tok: TokenizerWrapper) -> None:
    markers = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
    markers += ["<think>", "</think>"]
    special = set(tok.all_special_tokens)
    for marker in markers:
        ids = tok.encode(marker, add_special_tokens=False)
        assert len(ids) == 1 and marker not in special, marker
        assert tok.decode(ids, skip_special_tokens=True) == marker
    text = "<think>\nhm\n</think>\n\n<tool_call>\nx\n</tool_call>"
    detokenizer = tok.detokenizer
    for token in tok.encode(text, add_special_tokens=False):
        detokenizer.add_token(token)
    detokenizer.finalize()
    assert detokenizer.text == text


def test_thinking_generation_prompt(tok: TokenizerWrapper) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    assert render(tok, messages).endswith("<|im_start|>assistant\n<think>\n")
    off = render(tok, messages, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render(tok, messages, enable_thinking=True) == render(tok, messages)
    no_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert no_prompt == "<|im_start|>user\nHi<|im_end|>\n"


def test_tools_go_into_the_system_turn(hermes: TokenizerWrapper, coder: TokenizerWrapper):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for tok in (hermes, coder):
        text = render(tok, messages)
        assert text.startswith("<|im_start|>system\nBe brief.\n\n")
        assert text.count("<|im_start|>system") == 1
        assert "get_weather" in text and "The weather in a city" in text
        assert "<|im_start|>user\nHi<|im_end|>\n" in text
        plain = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert plain.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in render(hermes, messages)
    coded = render(coder, messages)
    assert "<function>\n<name>get_weather</name>\n<description>The weather in a city" in coded
    assert "<parameter>\n<name>city</name>\n<type>string</type>\n<description>the city" in coded
    assert '<enum>["c", "f"]</enum>' in coded and '<required>["city"]</required>' in coded


def test_history_calls_responses_and_reasoning(tok: TokenizerWrapper) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "\nTwo cities: two calls.\n",
            "tool_calls": [call("get_weather", {"city": "Paris"}), call("get_weather", ARGS)],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "rain"}]},
    ]
    text = render(tok, messages)
    assert (
        "<|im_start|>assistant\n<think>\nTwo cities: two calls.\n</think>\n\n<tool_call>\n" in text
    )
    assert "</tool_call>\n<tool_call>\n" in text  # one block per call, a newline between
    assert text.endswith(
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrain\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    parsed = [tok.tool_parser(block, TOOLS) for block in call_blocks(text)]
    assert parsed == [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "get_weather", "arguments": ARGS},
    ]
    # Reasoning of turns before the last user message is dropped, as in Qwen3's templates.
    later = [
        *messages,
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Ok"},
    ]
    text = render(tok, later)
    assert "Two cities" not in text and "<|im_start|>assistant\nDone.<|im_end|>" in text


def test_content_and_calls_in_one_turn(tok: TokenizerWrapper) -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [call("get_weather", ARGS)]},
    ]
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert "<|im_start|>assistant\nLet me look.\n<tool_call>\n" in text
    assert text.endswith("</tool_call><|im_end|>\n")


@pytest.mark.parametrize("arguments", [ARGS, ODD_STRING, {}], ids=["types", "string", "none"])
def test_call_round_trip(tok: TokenizerWrapper, arguments: dict[str, Any]) -> None:
    """A call the template renders into the history is what mlx-lm's parser reads back: the
    same name and arguments, through tokens and the streaming detokenizer too."""
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call("get_weather", arguments)]},
    ]
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    (block,) = call_blocks(text)
    assert tok.tool_parser(block, TOOLS) == {"name": "get_weather", "arguments": arguments}
    ids = tok.encode(text, add_special_tokens=False)
    start, end = tok.tool_call_start_tokens[0], tok.tool_call_end_tokens[0]
    i = len(ids) - ids[::-1].index(start)
    detokenizer = tok.detokenizer
    for token in ids[i : ids.index(end, i)]:
        detokenizer.add_token(token)
    detokenizer.finalize()
    assert detokenizer.text == block


def test_hermes_renders_string_arguments_as_given(hermes: TokenizerWrapper) -> None:
    def rendered(arguments: Any) -> str:
        messages = [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [call("get_weather", arguments)]},
        ]
        return str(hermes.apply_chat_template(messages, tools=TOOLS, tokenize=False))

    as_string = rendered(json.dumps(ARGS))
    assert as_string == rendered(ARGS)
    block = (
        '<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(ARGS) + "}\n</tool_call>"
    )
    assert block in as_string
    (text,) = call_blocks(as_string)
    assert hermes.tool_parser(text, TOOLS)["arguments"] == ARGS


def test_coder_refuses_string_arguments(coder: TokenizerWrapper) -> None:
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", "{}")]},
    ]
    with pytest.raises(jinja2.TemplateError, match="must be an object"):
        coder.apply_chat_template(messages, tools=TOOLS, tokenize=False)


def test_coder_call_block_text(coder: TokenizerWrapper) -> None:
    arguments = {"city": "Paris", "days": 3, "hourly": True, "where": {"lat": 1}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", arguments)]},
    ]
    text = coder.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert text.endswith(
        "<|im_start|>assistant\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
        '<parameter=hourly>\ntrue\n</parameter>\n<parameter=where>\n{"lat": 1}\n</parameter>\n'
        "</function>\n</tool_call><|im_end|>\n"
    )


def test_one_feature_alone(tmp_path_factory: pytest.TempPathFactory) -> None:
    small = {"hidden_size": 32, "num_layers": 1, "vocab_size": 300}
    root = tmp_path_factory.mktemp("alone")
    tools_only = load_tokenizer(
        build_tiny_model(root / "tools", TinyModelSpec(**small, tool_format="hermes"))
    )
    assert tools_only.tool_parser.__module__.endswith("json_tools")
    assert not tools_only.has_thinking
    assert "<think>" not in tools_only.get_vocab()
    text = render(tools_only, [{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>assistant\n") and "<tool_call>" in text
    thinking_only = load_tokenizer(
        build_tiny_model(root / "think", TinyModelSpec(**small, thinking=True))
    )
    assert thinking_only.tool_parser is None and thinking_only.has_thinking
    assert "<tool_call>" not in thinking_only.get_vocab()
    text = render(thinking_only, [{"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_plain_template_is_unchanged(tmp_path: Path) -> None:
    assert hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest() == PLAIN_SHA
    assert modelgen.CHAT_TEMPLATE is CHAT_TEMPLATE
    assert chat_template() is CHAT_TEMPLATE
    path = build_tiny_model(tmp_path, TinyModelSpec(hidden_size=32, num_layers=1, vocab_size=300))
    config = json.loads((path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    tok = load_tokenizer(path)
    assert tok.tool_parser is None and not tok.has_thinking
    assert len(tok) == json.loads((path / "config.json").read_text())["vocab_size"] == 300


def test_markers_pick_the_parser() -> None:
    hermes, coder = chat_template("hermes"), chat_template("qwen3_coder", thinking=True)
    assert "<tool_call>" in hermes and "tool_call.name" in hermes
    assert "<tool_call>\\n<function=" in coder and "<tool_call>\\n<function=" not in hermes
    with pytest.raises(ValueError, match="tool_format"):
        chat_template("xml")
    assert chat_templates.format_tokens(None, False) == []


def test_bad_format_specs_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tool_format"):
        build_tiny_model(tmp_path, TinyModelSpec(tool_format="xml"))
    with pytest.raises(ValueError, match="chat template"):
        build_tiny_model(tmp_path, TinyModelSpec(thinking=True, chat_template=False))


def test_demo_has_tools_and_thinking_off_by_default() -> None:
    assert (DEMO_SPEC.tool_format, DEMO_SPEC.thinking) == ("hermes", True)
    demo = Config().with_defaults().models[0]
    assert demo.is_demo
    assert demo.chat_template_kwargs == {"enable_thinking": False}
