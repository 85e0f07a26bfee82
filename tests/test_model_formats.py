"""A model's formats from its tokenizer (tool-call parser, thinking markers, the state its
output starts in), and the tools and arguments as chat templates take them."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from shared.types import Tool
from worker.backends.formats import arguments_object, model_formats, template_tools

# ---- a model's formats from its tokenizer ------------------------------------------------------


def test_model_formats_from_a_generated_model(hermes_model_dir: Path) -> None:
    tokenizer = load_tokenizer(hermes_model_dir)
    found = model_formats(tokenizer)
    assert found.tools is not None and found.tools.parser == "json_tools"
    assert found.tools.json_body
    (marker,) = tokenizer.encode("<tool_call>", add_special_tokens=False)
    assert found.tools.start_token == marker  # one token: masked inside thinking
    assert (found.think_start, found.think_end) == ("<think>", "</think>")
    assert found.thinking
    opened = tokenizer.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    closed = tokenizer.encode("<think>\nhm</think>\n", add_special_tokens=False)
    assert found.initial(opened, tokenizer) == "reasoning"
    assert found.initial(closed, tokenizer) == "normal"
    assert found.initial([], tokenizer) == "normal"
    named = model_formats(tokenizer, "pythonic")
    assert named.tools is not None and named.tools.start == "<|tool_call_start|>"
    assert named.tools.start_token is None  # several tokens in this vocabulary
    with pytest.raises(ValueError, match=r"engine\.tool_parser"):
        model_formats(tokenizer, "no_such_parser")


def test_the_output_may_open_a_think_block_unless_the_prompt_settled_it(
    hermes_model_dir: Path,
) -> None:
    tokenizer = load_tokenizer(hermes_model_dir)
    found = model_formats(tokenizer)

    def ids(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    turn = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert found.opens_thinking(ids(turn), tokenizer)  # left to the model (Qwen3)
    assert not found.opens_thinking(ids(turn + "<think>\n"), tokenizer)  # inside already
    off = ids(turn + "<think>\n\n</think>\n\n")  # enable_thinking=False
    assert not found.opens_thinking(off, tokenizer)
    history = "<|im_start|>assistant\n<think>\nx</think>\nold answer<|im_end|>\n"
    assert found.opens_thinking(ids(history + turn), tokenizer)  # an earlier turn's block


def test_template_tools_and_arguments_object() -> None:
    tools = [Tool("f", "does f", {"type": "object", "properties": {"a": {"type": "string"}}})]
    assert template_tools([*tools, Tool("g")]) == [
        {
            "type": "function",
            "function": {
                "name": "f",
                "description": "does f",
                "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
            },
        },
        {
            "type": "function",
            "function": {
                "name": "g",
                "description": "",
                "parameters": {"type": "object", "properties": {}},
            },
        },
    ]
    assert arguments_object('{"a": [1]}') == {"a": [1]}
    assert arguments_object("not json") == "not json"
