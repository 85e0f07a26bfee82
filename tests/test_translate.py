"""OpenAI chat and completion bodies -> canonical requests and sampling: defaults, the
sampling fields carried, stop strings, roles and text parts, max_completion_tokens, chat
template options, n and logprobs, prompt shapes and batches, echo."""

from __future__ import annotations

from shared.types import CanonicalRequest, Message, SamplingParams
from tests.openai_bodies import USER, chat, completion, completions, rejected


def test_minimal_chat_body() -> None:
    request, sampling = chat()
    assert request == CanonicalRequest(messages=[Message("user", "hi")])
    assert request.add_generation_prompt is True
    assert sampling == SamplingParams()  # OpenAI defaults: temperature 1, top_p 1, no limit


def test_minimal_completion_body() -> None:
    request, sampling = completion()
    assert request == CanonicalRequest(prompt="Once")
    assert sampling == SamplingParams()  # max_tokens: serve() applies 16 within the cap


def test_chat_sampling_fields_are_carried() -> None:
    _, sampling = chat(
        max_tokens=20,
        temperature=0,
        top_p=0.9,
        top_k=-1,
        min_p=0.05,
        seed=11,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias={"17": -100, "3": 2.5},
        ignore_eos=True,
        min_tokens=2,
        stop_token_ids=[5, 6],
        include_stop_str_in_output=True,
    )
    assert sampling == SamplingParams(
        max_tokens=20,
        temperature=0.0,
        top_p=0.9,
        top_k=0,
        min_p=0.05,
        seed=11,
        stop=[],
        stop_token_ids=[5, 6],
        ignore_eos=True,
        min_tokens=2,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={17: -100.0, 3: 2.5},
        include_stop_str_in_output=True,
    )


def test_stop_string_or_list() -> None:
    assert chat(stop="\n")[1].stop == ["\n"]
    assert chat(stop=["a", "bb"])[1].stop == ["a", "bb"]
    assert chat(stop=None)[1].stop == []
    assert completion(stop="END")[1].stop == ["END"]


def test_developer_role_is_system_and_text_parts_are_joined() -> None:
    messages = [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "name": "bot"},
    ]
    request, _ = chat(messages=messages)
    assert request.messages == [
        Message("system", "rules"),
        Message("user", "ab"),
        Message("assistant", "", name="bot"),
    ]


def test_max_completion_tokens_is_preferred() -> None:
    assert chat(max_completion_tokens=9)[1].max_tokens == 9
    assert chat(max_tokens=9, max_completion_tokens=9)[1].max_tokens == 9
    assert chat(max_tokens=7)[1].max_tokens == 7
    assert chat()[1].max_tokens is None
    error = rejected(chat, max_tokens=5, max_completion_tokens=9)
    assert error.param == "max_completion_tokens"


def test_chat_template_options() -> None:
    request, _ = chat(add_generation_prompt=False, chat_template_kwargs={"enable_thinking": False})
    assert request.add_generation_prompt is False
    assert request.chat_template_kwargs == {"enable_thinking": False}


def test_continue_final_message() -> None:
    messages = [*USER, {"role": "assistant", "content": "Once upon"}]
    request, _ = chat(messages=messages, continue_final_message=True, chat_template_kwargs={"x": 1})
    assert request.messages[-1] == Message("assistant", "Once upon")
    assert request.add_generation_prompt is False  # continuing, not starting a new turn
    assert request.chat_template_kwargs == {"x": 1, "continue_final_message": True}
    # off (the default): nothing is added
    assert "continue_final_message" not in chat(messages=messages)[0].chat_template_kwargs
    error = rejected(chat, continue_final_message=True)  # the last message is the user's
    assert error.param == "continue_final_message"


def test_chat_n_and_logprobs_are_served() -> None:
    _, sampling = chat(n=3, seed=5)
    assert sampling.seed == 5  # choice i gets seed + i when submitted (gateway/api/serve.py)
    assert (sampling.logprobs, sampling.top_logprobs) == (False, 0)
    assert chat(logprobs=True)[1].logprobs is True
    assert chat(logprobs=True)[1].top_logprobs == 0
    _, sampling = chat(logprobs=True, top_logprobs=20)
    assert (sampling.logprobs, sampling.top_logprobs) == (True, 20)
    _, sampling = chat(logprobs=False, top_logprobs=0)  # a neutral value
    assert (sampling.logprobs, sampling.top_logprobs) == (False, 0)


def test_completion_prompt_shapes() -> None:
    assert completion(prompt=["only one"])[0] == CanonicalRequest(prompt="only one")
    assert completion(prompt=[1, 2, 3])[0] == CanonicalRequest(prompt_token_ids=[1, 2, 3])
    assert completion(prompt=[[4, 5]])[0] == CanonicalRequest(prompt_token_ids=[4, 5])
    assert completion(max_tokens=3)[1].max_tokens == 3


def test_completion_prompt_batches() -> None:
    """A list of prompts is one job per prompt, in order, all with the same sampling."""
    jobs = completions(prompt=["a", "b", "c"], max_tokens=4, n=2)
    assert [request for request, _ in jobs] == [
        CanonicalRequest(prompt="a"),
        CanonicalRequest(prompt="b"),
        CanonicalRequest(prompt="c"),
    ]
    assert {sampling.max_tokens for _, sampling in jobs} == {4}
    jobs = completions(prompt=[[1, 2], [3]])
    assert [request.prompt_token_ids for request, _ in jobs] == [[1, 2], [3]]


def test_completion_echo_and_logprobs() -> None:
    _, sampling = completion(echo=True, logprobs=1, max_tokens=0)
    assert (sampling.echo, sampling.logprobs, sampling.top_logprobs) == (True, True, 1)
    assert sampling.max_tokens == 0  # scoring only
    _, sampling = completion(logprobs=0)  # the sampled token only, no alternatives
    assert (sampling.logprobs, sampling.top_logprobs) == (True, 0)
    _, sampling = completion(echo=True)
    assert (sampling.echo, sampling.logprobs) == (True, False)
    assert completion()[1].logprobs is False
    assert completion(best_of=3, n=3)[1] == SamplingParams()
