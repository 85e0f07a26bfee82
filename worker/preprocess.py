"""Add frame -> tokens and limits, on the input thread so the engine loop only steps."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import msgspec

from shared.config import EngineOptions
from shared.modelinfo import text_capabilities
from shared.protocol import Add
from shared.types import (
    CanonicalRequest,
    ErrorCode,
    Message,
    OutputFormat,
    RequestError,
    RequestKind,
    SamplingParams,
    ToolChoice,
    ToolChoiceMode,
    context_error,
    reserved_template_kwarg,
)
from worker.backends.formats import ModelFormats, arguments_object, model_formats, template_tools
from worker.parsing.response import ResponseParser
from worker.prompt_segments import prompt_segments, token_ids, whole_only
from worker.structured.grammars import GrammarError, response_grammar, tool_grammar
from worker.structured.guide import Grammars, Guide


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def capabilities(tokenizer: Any, formats: ModelFormats | None = None) -> list[str]:
    """What this text model serves (Ready.capabilities; the gateway checks requests against
    it): chat needs a chat template, tools a known call format, reasoning a think block;
    the rest every mlx-lm model does (structured output: llguidance's grammars)."""
    chat = has_chat_template(tokenizer)
    found = text_capabilities(chat)
    if formats is not None and chat:
        found += ["tools"] if formats.tools is not None else []
        found += ["reasoning"] if formats.thinking else []
    return found


class PreprocessError(Exception):
    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass(slots=True)
class PreparedRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    priority: int = 0
    received_at: float = 0.0  # perf_counter when the worker got it, and once prepared
    prepared_at: float = 0.0
    guide: Guide | None = None  # a grammar and/or a thinking budget over its tokens
    parser: ResponseParser | None = None  # its output split into answer, thinking, calls
    media: Any = None  # its images, as the model takes them (a vision model's)
    key: list[int] | None = None  # the prompt as the prefix cache keys it (images: content ids)
    # a continuation: the prompt's last `resumed` tokens are output an earlier worker made
    resumed: int = 0


class Preprocessor:
    # chat prompts tokenized by segments where engine.segment_tokens and the probe allow
    by_segments: ClassVar[bool] = True
    # Work a request need not wait for, off its path: a grammar compiles on its own thread
    # (the request waiting for its place meanwhile), and a prompt's segments are checked
    # against its whole encoding once the request went on (`run_checks`, called by the
    # worker's input thread). False: both here, before the request goes on (a sharded
    # group's ranks, which prepare requests on their engine threads and must decide alike).
    off_path: bool = True
    on_compiled: Callable[[], None] | None = None  # after each such compile (wakes the engine)

    def __init__(
        self,
        tokenizer: Any,
        options: EngineOptions,
        max_context: int,
        formats: ModelFormats | None = None,
        grammars: Grammars | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.options = options
        self.max_context = max_context
        self.vocab_size = len(tokenizer)
        self.formats = formats or model_formats(tokenizer, options.tool_parser)
        self._grammars = grammars
        chat = options.segment_tokens and self.by_segments and has_chat_template(tokenizer)
        self.segments = prompt_segments(tokenizer) if chat else None

    @property
    def grammars(self) -> Grammars:
        if self._grammars is None:  # built on first use: a tokenizer's map takes a moment
            self._grammars = Grammars(self.tokenizer, on_compiled=self._compiled)
        return self._grammars

    def _compiled(self) -> None:
        if self.on_compiled is not None:
            self.on_compiled()

    def __call__(self, frame: Add) -> PreparedRequest:
        frame = msgspec.structs.replace(frame, request=self._served(frame.request))
        param = _prompt_param(frame)
        self._check_token_ids(frame.sampling)
        self._check_features(frame.kind, frame.request)
        prompt = self._tokenize(frame.kind, frame.request, frame.request_id)
        if not prompt:
            raise _invalid("the prompt is empty after tokenization", param)
        limit = self.options.max_prompt_tokens
        if limit is not None and len(prompt) > limit:
            raise _invalid(
                f"the prompt has {len(prompt)} tokens; this gateway accepts at most {limit} "
                "(server.max_prompt_tokens)",
                param,
            )
        max_tokens = self._max_tokens(len(prompt), frame.sampling, param)
        resumed = self._resumed(frame.request.resumed, max_tokens)
        prepared = PreparedRequest(
            frame.request_id, prompt + resumed, max_tokens, frame.sampling, frame.priority
        )
        prepared.resumed = len(resumed)
        if frame.kind == RequestKind.CHAT:
            self._shape_output(prepared, frame.request)
        elif (fmt := frame.request.response_format) is not None:
            grammar = self._grammar(lambda: response_grammar(fmt))
            if grammar is not None:
                prepared.guide = self._guide(prepared, grammar, fmt.param)
        return prepared

    # ---- tools, thinking, structured output ------------------------------------------

    def _served(self, request: CanonicalRequest) -> CanonicalRequest:
        """The request as this model serves it: advisory thinking settings (Anthropic's)
        without what it cannot do: none for a model that does not think, no effort level
        for a template that takes none."""
        reasoning = request.reasoning
        if reasoning is None or not reasoning.advisory:
            return request
        if not self.formats.thinking:
            return msgspec.structs.replace(request, reasoning=None)
        if reasoning.effort is not None and not self.formats.takes_effort:
            reasoning = msgspec.structs.replace(reasoning, effort=None)
        return msgspec.structs.replace(request, reasoning=reasoning)

    def _check_features(self, kind: RequestKind, request: CanonicalRequest) -> None:
        """A 400 naming what this model cannot do (the gateway checks first, from Ready)."""
        if kind != RequestKind.CHAT:
            if request.tools or request.tool_choice is not None:
                raise _invalid("tools are served by chat requests only", "tools")
            if request.reasoning is not None:
                raise _invalid("reasoning is served by chat requests only", "reasoning")
            return
        needs = request.needs()
        if "tools" in needs and self.formats.tools is None:
            raise _invalid(
                "this model has no known tool-call format (its chat template names none "
                "mlx-lm knows; set engine.tool_parser if it has one)",
                "tools",
            )
        reasoning = request.reasoning
        if reasoning is not None and reasoning.enabled and not self.formats.thinking:
            raise _invalid("this model's chat template has no thinking", "reasoning")
        if reasoning is not None and reasoning.effort is not None and not self.formats.takes_effort:
            raise _invalid(
                "this model's chat template takes no reasoning effort", "reasoning_effort"
            )

    def _shape_output(self, prepared: PreparedRequest, request: CanonicalRequest) -> None:
        """The parser of its output, and the guide over its tokens when something is
        forced: a tool call (required or named), a strict tool's arguments, a response
        format (under auto: that JSON or calls), a thinking budget."""
        formats = self.formats
        choice = request.tool_choice
        calls = bool(request.tools) and (choice is None or choice.mode is not ToolChoiceMode.NONE)
        tools = template_tools(request.tools) if calls else None
        # where the output starts: in the prompt before a continuation's resumed tokens
        # (they are replayed through the parser and the guide as output)
        prompt = prepared.prompt[: len(prepared.prompt) - prepared.resumed]
        initial = formats.initial(prompt, self.tokenizer)
        # one call: parallel_tool_calls false, or a named choice (that tool, once)
        single = choice is not None and (not choice.parallel or choice.name is not None)
        if tools is not None or formats.marked:  # else its text is all answer: no parser
            prepared.parser = ResponseParser(formats, initial, tools, single)
        grammar, param, marker = None, "tools", None
        fmt = request.response_format
        if fmt is not None and fmt.type is OutputFormat.TEXT:
            fmt = None
        if calls:  # forced, or under auto a strict tool or the answer's format beside them
            literal, mode = self.grammars.literal, choice or ToolChoice()
            lenient = self.options.strict_tools == "best_effort"
            grammar = self._grammar(
                lambda: tool_grammar(request.tools, mode, formats.tools, literal, fmt, lenient)
            )
            if grammar is not None and formats.tools is not None:
                marker = formats.tools.start_token
            if fmt is not None and mode.mode is ToolChoiceMode.AUTO:
                param = fmt.param  # its errors name the format (its message the grammar's)
        if grammar is None and fmt is not None:
            grammar, param = self._grammar(lambda: response_grammar(fmt)), fmt.param
        budget = request.reasoning.budget_tokens if request.reasoning is not None else None
        if grammar is None and budget is None:
            return
        opens = formats.think_start_tokens or ()
        prepared.guide = self._guide(
            prepared,
            grammar,
            param,
            thinking=initial == "reasoning",
            end_tokens=formats.think_end_tokens or (),
            budget=budget,
            # a grammar's output opens with a think block only where the model may think
            start_tokens=opens
            if grammar is None or formats.opens_thinking(prompt, self.tokenizer)
            else (),
            call_marker=marker,
        )

    def _grammar(self, build: Any) -> str | None:
        try:
            return build()
        except GrammarError as exc:
            raise _invalid(str(exc), exc.param) from None
        except (TypeError, AttributeError, ValueError) as exc:  # a schema of the wrong shape
            raise _invalid(f"the schema cannot be made a constraint: {exc}") from None

    def _guide(
        self, prepared: PreparedRequest, grammar: str | None, param: str, **thinking: Any
    ) -> Guide:
        """The request's guide; its grammar compiled now where it is known already (or
        must be: a continuation replays its tokens through it when added), else on the
        grammar thread while the request waits (Guide.ready). A grammar that cannot be
        compiled is a 400 naming `param`, from here or from the engine."""
        words = self.grammars.words
        if grammar is None:
            return Guide(None, words=words, **thinking)
        future = self.grammars.compile(grammar)
        # here too for a request that is answered when added (max_tokens 0) or that replays
        # its tokens then (a continuation)
        waits = not prepared.resumed and prepared.max_tokens > 0
        if self.off_path and waits and not future.done():
            return Guide(None, words=words, compiling=future, param=param, **thinking)
        try:
            matcher = self.grammars.matcher(grammar)  # (compiled, or failed, by now)
        except ValueError as exc:
            raise _invalid(f"the constraint cannot be compiled: {exc}", param) from None
        return Guide(matcher, words=words, param=param, **thinking)

    def _check_token_ids(self, sampling: SamplingParams) -> None:
        for param, ids in (
            ("logit_bias", sampling.logit_bias),
            ("stop_token_ids", sampling.stop_token_ids),
        ):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise _invalid(
                    f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})", param
                )

    def tokenize_call(self, args: dict[str, Any]) -> dict[str, Any]:
        """Control "tokenize": {"kind", "request": CanonicalRequest} -> the prompt's tokens."""
        try:
            kind = RequestKind(args["kind"])
            request = msgspec.convert(args["request"], CanonicalRequest)
        except (KeyError, ValueError, msgspec.ValidationError) as exc:
            raise _invalid(f"bad tokenize call: {exc}") from exc
        request = self._served(request)
        self._check_features(kind, request)  # counted as a request would be served
        # whole: a call here is not one of the prompts the memo's checks take (rank 0 of a
        # sharded group answers these alone, and its ranks must decide alike on segments)
        tokens = self._tokenize(kind, request, by_segments=False)
        result: dict[str, Any] = {"tokens": tokens, "count": len(tokens)}
        result["max_context"] = self.max_context
        if args.get("with_text"):
            result["token_strs"] = [self.tokenizer.decode([t]) for t in tokens]
        return result

    def detokenize_call(self, args: dict[str, Any]) -> dict[str, Any]:
        tokens = args.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise _invalid("`tokens` must be a list of token ids", "tokens")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise _invalid(
                f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})", "tokens"
            )
        return {"text": self.tokenizer.decode(tokens)}

    def _tokenize(
        self,
        kind: RequestKind,
        request: CanonicalRequest,
        request_id: str = "",
        by_segments: bool = True,
    ) -> list[int]:
        if kind == RequestKind.CHAT:
            if not has_chat_template(self.tokenizer):
                raise _invalid(
                    "this model has no chat template: use /v1/completions with a prompt",
                    "messages",
                )
            messages = self._messages(request)
            kwargs: dict[str, Any] = dict(request.chat_template_kwargs)
            choice = request.tool_choice
            if request.tools and (choice is None or choice.mode is not ToolChoiceMode.NONE):
                kwargs["tools"] = template_tools(request.tools)
            reasoning = request.reasoning
            if reasoning is not None and reasoning.enabled is not None:
                kwargs["enable_thinking"] = reasoning.enabled
            if reasoning is not None and reasoning.effort is not None:
                kwargs["reasoning_effort"] = reasoning.effort
            reserved = reserved_template_kwarg(request.chat_template_kwargs)
            if reserved is not None:
                raise _invalid(
                    f"chat_template_kwargs.{reserved} is not a template variable",
                    f"chat_template_kwargs.{reserved}",
                )
            return self._chat_tokens(messages, request, kwargs, request_id, by_segments)
        if request.prompt_token_ids is not None:
            bad = [t for t in request.prompt_token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise _invalid(f"token id {bad[0]} is outside the vocabulary", "prompt")
            return list(request.prompt_token_ids)
        return list(self.tokenizer.encode(request.prompt or "", add_special_tokens=True))

    def _chat_tokens(
        self,
        messages: list[dict[str, Any]],
        request: CanonicalRequest,
        kwargs: dict[str, Any],
        request_id: str,
        by_segments: bool,
    ) -> list[int]:
        """The chat template applied: its text tokenized by segments where this model's
        prompts allow it (worker/prompt_segments.py) and `by_segments`, else the template's
        own ids."""

        def whole() -> list[int]:
            return _template_ids(self._render(messages, request, kwargs))

        segments = self.segments
        if segments is None or not by_segments or not segments.on or whole_only(kwargs):
            return whole()
        text = self._template(messages, request, kwargs, tokenize=False)
        if not isinstance(text, str):
            return whole()
        return segments.encode(text, whole, request_id, self.off_path)

    def run_checks(self) -> None:
        """The segment checks left for after their requests went on (`off_path`)."""
        if self.segments is not None:
            self.segments.run_checks()

    def _resumed(self, tokens: list[int], max_tokens: int) -> list[int]:
        """A continuation's tokens (the gateway's: a 400 here is a bug there, never silent)."""
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise _invalid(f"resumed token id {bad[0]} is outside the vocabulary", "resumed")
        if tokens and len(tokens) >= max_tokens:
            raise _invalid(f"{len(tokens)} tokens resumed of max_tokens {max_tokens}", "resumed")
        return list(tokens)

    def _messages(self, request: CanonicalRequest) -> list[dict[str, Any]]:
        """The messages as chat templates read them (a vision worker's take images)."""
        for i, m in enumerate(request.messages):
            if m.parts:  # the gateway refuses these first; never drop them silently
                raise _invalid(
                    f"messages[{i}].parts: images and audio are not served by a text worker",
                    f"messages[{i}].parts",
                )
        return [_message_dict(m) for m in request.messages]

    def _render(
        self, messages: list[dict[str, Any]], request: CanonicalRequest, kwargs: dict[str, Any]
    ) -> Any:
        """The chat template applied: token ids."""
        return self._template(messages, request, kwargs, tokenize=True)

    def _template(
        self,
        messages: list[dict[str, Any]],
        request: CanonicalRequest,
        kwargs: dict[str, Any],
        tokenize: bool,
    ) -> Any:
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=request.add_generation_prompt,
                tokenize=tokenize,
                **kwargs,
            )
        except Exception as exc:  # jinja errors carry the template's own message
            raise _invalid(f"the chat template rejected the messages: {exc}", "messages") from exc

    def _max_tokens(self, prompt_len: int, sampling: SamplingParams, param: str) -> int:
        room = self.max_context - prompt_len
        requested = sampling.max_tokens
        if requested is None:
            default = self.options.default_max_tokens
            requested = min(room, default) if default else room
        if room <= 0 or requested > room:
            # the prompt alone, when no length was asked for and it leaves no room
            asked = None if sampling.max_tokens is None and room <= 0 else requested
            raise PreprocessError(context_error(self.max_context, prompt_len, asked, param))
        if requested == 0 and sampling.echo:
            return 0  # score the prompt only
        if requested < 1:
            raise _invalid("max_tokens must be at least 1", "max_tokens")
        if sampling.min_tokens > requested:
            raise _invalid("min_tokens must not exceed max_tokens", "min_tokens")
        return requested


def _template_ids(ids: Any) -> list[int]:
    """The chat template's token ids, or a 400 where it made something else."""
    try:
        tokens = token_ids(ids) if not isinstance(ids, str) else None
    except (TypeError, KeyError):
        tokens = None
    if tokens is None or not all(type(t) is int for t in tokens):
        raise _invalid(
            "the chat template did not produce token ids (check chat_template_kwargs)",
            "chat_template_kwargs",
        )
    return tokens


def _prompt_param(frame: Add) -> str:
    return "messages" if frame.kind == RequestKind.CHAT else "prompt"


def _message_dict(m: Message) -> dict[str, Any]:
    """A message as chat templates read it (OpenAI's shape, as Hugging Face's templates
    expect: tool_calls with their arguments as objects, tool_call_id, reasoning_content)."""
    message: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name:
        message["name"] = m.name
    if m.tool_calls:
        message["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": arguments_object(call.arguments)},
            }
            for call in m.tool_calls
        ]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if m.reasoning is not None:
        message["reasoning_content"] = m.reasoning
    return message


def _invalid(message: str, param: str | None = None) -> PreprocessError:
    return PreprocessError(RequestError(ErrorCode.INVALID_REQUEST, message, param))
