"""OpenAI request and response bodies as msgspec Structs.

Requests forbid unknown fields, so a parameter we do not implement is a 400 naming it, never
silently ignored. vLLM's extensions that benchmarks rely on (ignore_eos, min_tokens, top_k,
min_p, repetition_penalty, stop_token_ids) are accepted.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

# Integers are bounded: a value beyond what the wire (msgpack) carries is a 400, not a 500.
INT32 = 2**31 - 1
NonNegInt = Annotated[int, Meta(ge=0, le=INT32)]
PosInt = Annotated[int, Meta(ge=1, le=INT32)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
# Stop strings are checked at every token: their number and length are bounded
StopString = Annotated[str, Meta(max_length=1024)]
StopList = Annotated[list[StopString], Meta(max_length=16)]
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]


class _Body(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass


class ImageUrl(_Body):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class InputAudio(_Body):
    data: str  # base64
    format: str


class ContentPart(msgspec.Struct, omit_defaults=True):
    type: str
    text: str | None = None
    image_url: ImageUrl | None = None
    input_audio: InputAudio | None = None


class FunctionCallIn(_Body):
    name: str
    arguments: str


class ToolCallIn(_Body):
    id: str
    function: FunctionCallIn
    type: Literal["function"] = "function"


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None  # an assistant's thinking (vLLM, DeepSeek)
    refusal: str | None = None  # an assistant's refusal, as OpenAI returns it
    # An assistant message as the SDK returns it carries these, null or empty: sent back
    # (`message.model_dump()`), that is no use of them; a value is a 400 naming it
    audio: Any | None = None
    function_call: Any | None = None
    annotations: list[Any] | None = None


class StreamOptions(_Body):
    include_usage: bool = False
    # Random padding against length side channels: never added here (accepted either way).
    include_obfuscation: bool | None = None


class FunctionDef(_Body):
    """A function tool: its arguments' JSON schema in `parameters`."""

    name: str = ""  # checked in tools.py, so a missing name is named like a bad one
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(_Body):
    """A tool: only "function" is served; a custom tool is read only to be refused by its
    type (in tools.py) rather than by its fields."""

    type: str
    function: FunctionDef | None = None
    custom: Any | None = None


class FunctionName(_Body):
    name: str


class ToolChoiceParam(_Body):
    """{"type": "function", "function": {"name": ...}}; allowed_tools and custom are read
    only to be refused by their type (in tools.py)."""

    type: str
    function: FunctionName | None = None
    allowed_tools: Any | None = None
    custom: Any | None = None


class JsonSchemaParam(_Body):
    name: str
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Body):
    type: str
    json_schema: JsonSchemaParam | None = None


class SamplingFields(_Body):
    """Fields shared by chat and completions requests."""

    model: str
    max_tokens: PosInt | None = None
    temperature: Temperature | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=INT32)] | None = None
    min_p: Probability | None = None
    # OpenAI's SDKs type these as optional, and wrappers forward a null: it means the default
    n_given: PosInt | None = msgspec.field(default=None, name="n")
    stream_given: bool | None = msgspec.field(default=None, name="stream")
    stream_options: StreamOptions | None = None
    stop: StopString | StopList | None = None
    # Any integer msgpack carries (int64 or uint64; checked in translate: msgspec bounds stop
    # at int64); MLX keys take it modulo 2**64.
    seed: int | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] | None = None
    logit_bias: dict[str, Annotated[float, Meta(ge=-100, le=100)]] | None = None
    user: str | None = None  # an end-user id: in the request's access-log line
    safety_identifier: str | None = None  # likewise (user is logged when both come)
    prompt_cache_key: str | None = None  # a caching hint: prefix reuse needs none
    service_tier: Literal["auto", "default"] | None = None  # one tier here
    store: bool | None = None  # False only: nothing is kept for distillation
    metadata: dict[str, str] | None = None  # only with store, as in OpenAI: refused
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    stop_token_ids: list[NonNegInt] | None = None
    include_stop_str_in_output: bool = False
    # How long the model stays loaded after this request (as Ollama's keep_alive): seconds,
    # or "30m" / "2h"; 0 unloads it after this request, a negative value never.
    keep_alive: float | str | None = None

    @property
    def n(self) -> int:
        return self.n_given or 1

    @property
    def stream(self) -> bool:
        return bool(self.stream_given)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] = []
    max_completion_tokens: PosInt | None = None
    logprobs_given: bool | None = msgspec.field(default=None, name="logprobs")  # null: false
    top_logprobs: TopLogprobs | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolParam] | None = None
    tool_choice: str | ToolChoiceParam | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    modalities: list[str] | None = None
    # Documented OpenAI fields this gateway cannot honour: a 400 naming each.
    functions: Any | None = None
    function_call: Any | None = None
    audio: Any | None = None
    prediction: Any | None = None
    verbosity: Any | None = None
    web_search_options: Any | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, str | bool | int | float] | None = None

    @property
    def logprobs(self) -> bool:
        return bool(self.logprobs_given)


class CompletionRequest(SamplingFields):
    # msgspec allows one array type per union: the list's shape is checked in translate.
    prompt: str | list[str | NonNegInt | list[NonNegInt]] = ""
    max_tokens: NonNegInt | None = None  # 0 with echo: score the prompt only
    echo_given: bool | None = msgspec.field(default=None, name="echo")  # null: false
    suffix: str | None = None
    best_of: PosInt | None = None
    logprobs: TopLogprobs | None = None
    response_format: ResponseFormat | None = None  # json_object / json_schema, as vLLM

    @property
    def echo(self) -> bool:
        return bool(self.echo_given)


# ---- responses --------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0  # prompt tokens the worker's prefix cache served (no prefill)


class CompletionTokensDetails(msgspec.Struct):
    reasoning_tokens: int


class UsageBody(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int  # all of the prompt, cached tokens included
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    # only when the model thought: of completion_tokens, those spent thinking
    completion_tokens_details: CompletionTokensDetails | None = None


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None  # a call's first chunk only
    arguments: str | None = None  # always set: "" or the next fragment of the JSON text


class ToolCallChunk(msgspec.Struct, omit_defaults=True, kw_only=True):
    """A call's first chunk has its id, type and name; later ones more arguments."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDelta


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallChunk] | None = None


class TopLogprobBody(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class LogprobContent(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprobBody]


class ChoiceLogprobs(msgspec.Struct):
    content: list[LogprobContent] | None
    refusal: None = None


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    object: str = "chat.completion.chunk"
    system_fingerprint: str | None = None
    usage: UsageBody | None = None


class FunctionCallOut(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallOut(msgspec.Struct):
    id: str
    function: FunctionCallOut
    type: str = "function"


class AssistantMessage(msgspec.Struct):
    """`content` is null when the turn is only calls; the keys it does not use are left
    out (UNSET), so a plain answer keeps its bytes."""

    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCallOut] | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageBody
    object: str = "chat.completion"
    system_fingerprint: str | None = None


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    system_fingerprint: str | None = None
    usage: UsageBody | None = None


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorDetail


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str
    object: str = "model"
    state: str = "unloaded"
    aliases: list[str] = []
    description: str | None = None
    max_context: int | None = None  # tokens: prompt + completion (None until first loaded)
    context_length: int | None = None  # the same, under the name vLLM and others use
    capabilities: list[str] | None = None  # what requests it serves (None until first loaded)
    kind: str = "llm"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class RequestCancelled(msgspec.Struct):
    """POST /v1/requests/{id}/cancel: the request's id and how many of its choices were
    still running and are now aborted (0: it had already finished)."""

    id: str
    cancelled_choices: int
    object: str = "request.cancelled"
