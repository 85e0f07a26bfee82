"""Canonical request types: what every protocol adapter translates into.

These Structs are the single source of truth shared by the gateway and the workers. Wire
compatibility rule: fields are only ever appended, always with defaults.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import msgspec


class RequestKind(enum.StrEnum):
    CHAT = "chat"
    COMPLETION = "completion"
    EMBEDDING = "embedding"  # vectors of `inputs` / `input_token_ids` (an embedding model)
    RERANK = "rerank"  # relevance of `documents` to `query` (a cross-encoder, or similarity)
    TRANSCRIPTION = "transcription"  # `audio` to text in its own language (speech to text)
    TRANSLATION = "translation"  # `audio` to English text
    SPEECH = "speech"  # `prompt` read aloud: audio in `audio_format` (text to speech)


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    TOOL_CALLS = "tool_calls"  # the model called tools (its turn ends with the calls)


class Priority(enum.IntEnum):
    INTERACTIVE = 0
    BATCH = 1


class ErrorCode(enum.StrEnum):
    """Errors that cross the process boundary as values."""

    INVALID_REQUEST = "invalid_request"
    MODEL_NOT_FOUND = "model_not_found"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    WORKER_DIED = "worker_died"
    WORKER_UNAVAILABLE = "worker_unavailable"
    OVERLOADED = "overloaded"
    TIMEOUT = "timeout"
    INTERNAL = "internal"
    SHUTTING_DOWN = "shutting_down"
    CANCELLED = "cancelled"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    RATE_LIMITED = "rate_limited"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    NOT_FOUND = "not_found"  # an unknown or expired id (a stored response, a request)


class TextPart(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="text"):
    text: str


class ImagePart(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="image"):
    """An image: its bytes (a data URL or base64 source, decoded by the gateway), or a URL
    for the gateway to fetch."""

    data: bytes = b""
    media_type: str | None = None  # image/png, image/jpeg, ...
    url: str | None = None  # http(s), when not fetched yet
    detail: str | None = None  # OpenAI's "low" / "high" / "auto"
    # where the client put it, in its protocol's terms (messages[0].content[1].image_url):
    # errors about this image name it
    where: str | None = None


class AudioPart(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="audio"):
    data: bytes = b""
    format: str = ""  # wav, mp3, ...: the container the bytes are in
    url: str | None = None


ContentPart = TextPart | ImagePart | AudioPart


class ToolCall(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A call the assistant made: `arguments` is the JSON text of its arguments."""

    id: str
    name: str
    arguments: str = "{}"


class Message(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One turn of a conversation, whatever protocol it came in.

    `content` is the message's text. `parts` is empty for text-only messages; when the
    message has images or audio it holds every part in order (its text parts too).
    An assistant turn may carry `tool_calls` and its `reasoning` (thinking text); a `tool`
    turn answers the call `tool_call_id` with `content`.
    """

    role: str  # system, user, assistant, tool
    content: str = ""
    name: str | None = None
    parts: list[ContentPart] = []
    tool_calls: list[ToolCall] = []
    tool_call_id: str | None = None
    reasoning: str | None = None

    def extras(self) -> list[str]:
        """The fields beyond role, text and name that this message uses."""
        used = [
            ("parts", bool(self.parts)),
            ("tool_calls", bool(self.tool_calls)),
            ("tool_call_id", self.tool_call_id is not None),
            ("reasoning", self.reasoning is not None),
        ]
        return [name for name, is_used in used if is_used]


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Sampling and stopping, decided entirely in the worker."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = {}
    include_stop_str_in_output: bool = False
    # Log probabilities of each sampled token (after logits processors, before temperature),
    # with the `top_logprobs` most likely alternatives.
    logprobs: bool = False
    top_logprobs: int = 0
    # Completions' echo: the prompt's text (and, with logprobs, each prompt token's logprob)
    # comes back in the first delta; max_tokens may then be 0 (score the prompt only).
    echo: bool = False


class Tool(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A function the model may call: `parameters` is its arguments' JSON schema."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = {}
    strict: bool = False


class ToolChoiceMode(enum.StrEnum):
    AUTO = "auto"  # the model decides
    NONE = "none"  # no calls (the tools still go into the prompt)
    REQUIRED = "required"  # at least one call (with `name`: a call of that tool)


class ToolChoice(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    mode: ToolChoiceMode = ToolChoiceMode.AUTO
    name: str | None = None  # REQUIRED: the one tool to call
    parallel: bool = True  # False: at most one call per turn


class OutputFormat(enum.StrEnum):
    TEXT = "text"
    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"  # JSON valid against `schema`


class ResponseFormat(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Structured output: the answer is constrained token by token (worker/constraints)."""

    type: OutputFormat = OutputFormat.TEXT
    schema: dict[str, Any] | None = None
    name: str | None = None
    strict: bool = False
    param: str = "response_format"  # the request field that asked, for its 400s


class Reasoning(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Thinking, for models whose template has it: on or off (None: the template's
    default), at most `budget_tokens` of it, and an effort level for templates that take
    one (gpt-oss's `reasoning_effort`). `advisory` (Anthropic's adaptive thinking and its
    effort, which are guidance): what the model cannot do is left out, no thinking for a
    model without, no effort level for a template that takes none; only a budget is asked
    of it."""

    enabled: bool | None = None
    budget_tokens: int | None = None
    effort: str | None = None
    advisory: bool = False

    @property
    def required(self) -> bool:
        """It asks for thinking a model must have."""
        if self.advisory:
            return self.budget_tokens is not None
        return self != Reasoning(enabled=False)


class CanonicalRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A generation request, independent of the HTTP protocol it arrived in.

    Chat requests carry `messages` (the worker applies the model's chat template);
    completion requests carry `prompt` text or `prompt_token_ids`. `tools` go into the
    prompt through the template; `tool_choice` and `response_format` constrain the output.
    """

    messages: list[Message] = []
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, str | bool | int | float] = {}
    tools: list[Tool] = []
    tool_choice: ToolChoice | None = None  # None: AUTO when there are tools
    response_format: ResponseFormat | None = None
    reasoning: Reasoning | None = None
    # An embedding request's texts, or its token arrays (one of the two).
    inputs: list[str] = []
    input_token_ids: list[list[int]] = []
    # A rerank request's query and documents.
    query: str | None = None
    documents: list[str] = []
    # An embedding request's vector size: its first components (a Matryoshka model's)
    dimensions: int | None = None
    # Speech. Transcription and translation: the `audio` to hear (its bytes, in any container
    # the worker decodes), its `language` (ISO-639-1; None: detected), `prompt` the text
    # before it, `timestamps` the granularities to report ("segment", "word"). Speech:
    # `prompt` read in `voice` at `speed`, as `audio_format` (wav, pcm, mp3, flac, ...).
    audio: AudioPart | None = None
    language: str | None = None
    timestamps: list[str] = []
    voice: str | None = None
    speed: float | None = None
    audio_format: str | None = None
    # A continuation, after the worker that served this request died: the tokens it had
    # made and the gateway had received. The worker prefills them after the prompt, reads
    # them as it would have made them (text, stops, thinking, tool calls, grammar), and
    # sends only what follows; max_tokens, usage and a seed's draws count them.
    resumed: list[int] = []

    def needs(self) -> list[str]:
        """The model capabilities this request uses beyond plain text."""
        needs = []
        choice = self.tool_choice
        if self.tools and (choice is None or choice.mode is not ToolChoiceMode.NONE):
            needs.append("tools")
        fmt = self.response_format
        if fmt is not None and fmt.type is not OutputFormat.TEXT:
            needs.append("structured_output")
        if self.reasoning is not None and self.reasoning.required:
            needs.append("reasoning")
        parts = [part for message in self.messages for part in message.parts]
        if any(isinstance(part, ImagePart) for part in parts):
            needs.append("vision")
        if any(isinstance(part, AudioPart) for part in parts):
            needs.append("audio_input")
        return needs


# apply_chat_template's own parameters: `chat_template_kwargs` may only set template
# variables (continue_final_message is served as a request field of its own and passes).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def reserved_template_kwarg(kwargs: Mapping[str, object]) -> str | None:
    """The first key of `kwargs` that is not a template variable, or None."""
    return next((key for key in kwargs if key in RESERVED_TEMPLATE_KWARGS), None)


class Usage(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Final on the terminal delta; the first delta carries the prompt's count already."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0  # of completion_tokens, those spent thinking


class Timings(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Where a request's time to first token went inside the worker, in seconds: preparing
    it (chat template, tokenizing), waiting for a place in the batch (and for its grammar's
    compile), and from joining the batch to its first token (prefill and the first step).
    Sent with the first token."""

    preprocess_s: float = 0.0
    queue_s: float = 0.0
    prefill_s: float = 0.0


class RequestError(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    code: ErrorCode
    message: str
    param: str | None = None
    # a context overflow's figures (context_error): [max context, prompt tokens, tokens
    # asked for (0: none)]
    context: list[int] = []


def context_error(max_context: int, prompt: int, requested: int | None, param: str) -> RequestError:
    """A CONTEXT_LENGTH_EXCEEDED error: OpenAI's words (which clients parse) for the prompt
    alone (`requested` None: no length was asked for) or with the completion, and the
    figures, for protocols that say it their own way."""
    if requested is None:
        message = (
            f"This model's maximum context length is {max_context} tokens. However, your "
            f"messages resulted in {prompt} tokens. Please reduce the length of the messages."
        )
    else:
        message = (
            f"This model's maximum context length is {max_context} tokens. However, you "
            f"requested {prompt + requested} tokens ({prompt} in the prompt, {requested} for "
            "the completion). Please reduce the length of the prompt or of max_tokens."
        )
    figures = [max_context, prompt, requested or 0]
    return RequestError(ErrorCode.CONTEXT_LENGTH_EXCEEDED, message, param, figures)


class TopLogprob(msgspec.Struct, array_like=True, gc=False):
    token_id: int
    token: str  # the token's text as the tokenizer decodes it alone (U+FFFD for a partial
    logprob: float  # UTF-8 character)
    token_bytes: bytes = b""  # the token's own bytes (a byte token: that one byte)


class TokenLogprob(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One position: the token there, its log probability (None for a prompt's first token,
    which nothing predicts) and the most likely tokens at that position, best first."""

    token_id: int
    token: str
    logprob: float | None = None
    top: list[TopLogprob] = []
    token_bytes: bytes = b""


class ToolCallDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A piece of the `index`th tool call of a turn: its first delta has its id and name,
    the next ones more of its arguments' JSON text (in order; joined they are the whole)."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


class Word(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A transcribed word and when it was said (seconds from the audio's start)."""

    word: str
    start: float
    end: float


class Segment(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A stretch of transcribed audio, with what the model says of its confidence (OpenAI's
    verbose_json fields)."""

    id: int
    start: float
    end: float
    text: str
    tokens: list[int] = []
    temperature: float = 0.0
    avg_logprob: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0
    words: list[Word] = []


class RequestOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's delta for one request. Terminal when finish_reason is set. `text` is the
    answer; thinking goes to `reasoning` and tool calls to `tool_calls`, never into it."""

    request_id: str
    text: str = ""
    token_ids: list[int] = []
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: RequestError | None = None
    logprobs: list[TokenLogprob] = []  # one per token in token_ids that produced text
    prompt_logprobs: list[TokenLogprob] = []  # echo + logprobs: one per prompt token (first delta)
    prompt_text: str | None = None  # echo: the prompt as the tokenizer decodes it (first delta)
    stop: str | None = None  # the stop string that ended generation (finish_reason "stop")
    timings: Timings | None = None  # with the first token: the worker's share of its wait
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = []
    # An embedding request's vectors: float32, little-endian, one after the other, each
    # `dimensions` long (in the order of its inputs).
    embeddings: bytes = b""
    dimensions: int = 0
    scores: list[float] = []  # a rerank request's: each document's relevance, in order
    # Speech: a transcription's segments (and words) with its terminal output, the language
    # heard; a speech request's next bytes of audio, in its audio_format. `duration`: the
    # seconds of audio heard or made (with the terminal output).
    segments: list[Segment] = []
    language: str | None = None
    audio: bytes = b""
    duration: float | None = None
