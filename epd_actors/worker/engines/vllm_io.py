"""Conversions between the native protocol and vLLM's inputs and outputs (no vLLM import).

Requests become vLLM prompts (:func:`render_prompt`: token ids and text pass
through, chat messages go through the model's chat template with a media
placeholder where each media part is; media decoded once per item) and
``SamplingParams`` keyword arguments (:func:`sampling_kwargs`); vLLM's
``RequestOutput`` objects in ``DELTA`` mode become :class:`Delta` messages
(:class:`StreamAccumulator`).  Everything here is synchronous and pure apart
from media decoding, so it runs in a worker thread or inline.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final, Protocol

from ...errors import EngineError
from ...protocol import (
    ChatMessage,
    Delta,
    ErrorCode,
    MediaItem,
    Prompt,
    SamplingParams,
    TokenLogprob,
    Usage,
)
from .vllm_media import DECODERS

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

__all__ = [
    "FAILED_FINISH_REASONS",
    "VLLM_OPTIONS",
    "CompletionOutputLike",
    "MediaDecoder",
    "RenderedPrompt",
    "RequestOutputLike",
    "StreamAccumulator",
    "check_finish",
    "decode_media_item",
    "render_prompt",
    "sampling_kwargs",
    "wire_params",
]

# vLLM finish reasons that mean the request did not complete.
FAILED_FINISH_REASONS: Final = frozenset({"abort", "error"})

MediaDecoder = Callable[[MediaItem], object]
"""Turns a media item into what vLLM's ``multi_modal_data`` takes for its kind."""


# ---------------------------------------------------------------- vLLM's outputs, as read


class CompletionOutputLike(Protocol):
    """The parts of vLLM's ``CompletionOutput`` the adapter reads."""

    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def text(self) -> str: ...
    @property
    def logprobs(self) -> Any:
        """Per token, a mapping token id -> object with ``.logprob`` (None unless asked)."""

    @property
    def finish_reason(self) -> str | None: ...


class RequestOutputLike(Protocol):
    """The parts of vLLM's ``RequestOutput`` the adapter reads.

    ``ec_transfer_params`` is read with ``getattr`` (absent in older vLLM).
    """

    @property
    def outputs(self) -> Sequence[CompletionOutputLike]: ...
    @property
    def finished(self) -> bool: ...
    @property
    def prompt_token_ids(self) -> Sequence[int] | None: ...
    @property
    def kv_transfer_params(self) -> Mapping[str, Any] | None: ...


# ---------------------------------------------------------------- requests -> vLLM inputs


SAMPLING_OPTIONS: Final = frozenset(
    {
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_p",
        "ignore_eos",
        "stop_token_ids",
        "bad_words",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "allowed_token_ids",
        "logit_bias",
    }
)
"""Request options that are ``SamplingParams`` arguments of the same name."""

STRUCTURED_OPTIONS: Final[dict[str, Callable[[Any], dict[str, Any]]]] = {
    "structured_outputs": lambda value: dict(value),
    "guided_json": lambda value: {"json": value},
    "guided_regex": lambda value: {"regex": value},
    "guided_choice": lambda value: {"choice": value},
    "guided_grammar": lambda value: {"grammar": value},
    "structural_tag": lambda value: {"structural_tag": value},
    "response_format": lambda value: _response_format(value),
}
"""Request options that constrain the output, each as ``StructuredOutputsParams`` fields."""

TEMPLATE_OPTIONS: Final = frozenset(
    {"chat_template_kwargs", "add_generation_prompt", "continue_final_message"}
)
"""Request options that shape how chat messages are rendered (:func:`render_prompt`)."""

PROCESSOR_OPTIONS: Final = frozenset({"mm_processor_kwargs"})
"""Request options for the model's multimodal processor: a prompt's ``mm_processor_kwargs``."""

VLLM_OPTIONS: Final = (
    SAMPLING_OPTIONS | STRUCTURED_OPTIONS.keys() | TEMPLATE_OPTIONS | PROCESSOR_OPTIONS
)
"""Every request option the native vLLM engine honours; it refuses the others."""


def _response_format(value: Mapping[str, Any]) -> dict[str, Any]:
    kind = value.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        schema = value.get("json_schema") or {}
        return {"json": schema.get("schema", {})}
    if kind == "structural_tag":
        return {"structural_tag": json.dumps(value)}
    return {}  # "text": no constraint


def sampling_kwargs(
    sampling: SamplingParams,
    *,
    output_kind: str,
    max_tokens: int | None = None,
    extra_args: Mapping[str, Any] | None = None,
    options: Mapping[str, object] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """vLLM ``SamplingParams`` keyword arguments for ``sampling`` and the request's ``options``.

    What the client left unset comes from ``defaults`` (the model's generation
    config, as vLLM's own OpenAI server applies it), then from vLLM's own
    defaults; ``max_tokens`` left unset is passed as None, which vLLM turns
    into the rest of the context window.  A ``max_tokens`` given here
    overrides the request's (E and P ask for one token; then ``min_tokens``,
    ``stop`` and ``logprobs`` are dropped too).  Structured-output options
    become one ``structured_outputs`` map of ``StructuredOutputsParams`` fields.
    """
    one_token = max_tokens is not None
    kwargs: dict[str, Any] = dict(defaults or {})
    for name in ("temperature", "top_p", "top_k"):
        value = getattr(sampling, name)
        if value is not None:
            kwargs[name] = value
    kwargs.update(
        max_tokens=sampling.max_tokens if max_tokens is None else max_tokens,
        seed=sampling.seed,
        min_tokens=0 if one_token else sampling.min_tokens,
        stop=[] if one_token else list(sampling.stop),
        logprobs=None if one_token else sampling.logprobs,
        output_kind=output_kind,
    )
    structured: dict[str, Any] = {}
    for name, value in (options or {}).items():
        if name == "logit_bias" and isinstance(value, dict):
            kwargs[name] = {int(token): bias for token, bias in value.items()}
        elif name in SAMPLING_OPTIONS:
            kwargs[name] = value
        elif name in STRUCTURED_OPTIONS:
            structured.update(STRUCTURED_OPTIONS[name](value))
    if structured:
        kwargs["structured_outputs"] = structured
    if extra_args:
        kwargs["extra_args"] = dict(extra_args)
    return kwargs


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """A vLLM prompt (``TextPrompt``/``TokensPrompt`` dict) and how to tokenize it."""

    prompt: dict[str, Any]
    tokenization_kwargs: dict[str, Any] | None = None


def decode_media_item(item: MediaItem) -> object:
    """Decode an item the way vLLM's server does for its kind (:mod:`.vllm_media`).

    Raises:
        EngineError: ``invalid_request`` for a kind vLLM takes no data for and
            undecodable bytes; ``engine_error`` when the kind's libraries are missing.
    """
    decoder = DECODERS.get(item.modality)
    if decoder is None:
        raise EngineError(
            ErrorCode.INVALID_REQUEST, f"the vLLM engine cannot decode {item.mime_type}"
        )
    return decoder(item)


def _invalid(message: str) -> EngineError:
    return EngineError(ErrorCode.INVALID_REQUEST, message)


def _conversation(
    messages: Sequence[ChatMessage], media: Sequence[MediaItem]
) -> tuple[list[dict[str, Any]], list[int]]:
    """Chat messages for a Hugging Face chat template, and the media order they use.

    A text-only message keeps string content (every template handles that); a
    message with media becomes a list of ``{"type": "text"}`` and ``{"type":
    "image"}`` (or audio, video) parts where the client put them.  A message's
    other keys (``tool_calls``, ``tool_call_id``, ``name``) go along, with
    each tool call's JSON ``arguments`` decoded, as vLLM's server hands them
    to templates.
    """
    conversation: list[dict[str, Any]] = []
    order: list[int] = []
    for message in messages:
        extra = _template_fields(message.fields)
        if all(isinstance(part, str) for part in message.parts):
            text = "".join(map(str, message.parts))
            conversation.append({**extra, "role": message.role, "content": text})
            continue
        content: list[dict[str, Any]] = []
        for part in message.parts:
            if isinstance(part, str):
                content.append({"type": "text", "text": part})
                continue
            if not 0 <= part < len(media):
                raise _invalid(f"message part refers to media item {part} of {len(media)}")
            content.append({"type": media[part].modality})
            order.append(part)
        conversation.append({**extra, "role": message.role, "content": content})
    unused = sorted(set(range(len(media))) - set(order))
    if unused:
        raise _invalid(f"media item {unused[0]} is not referenced by any message part")
    return conversation, order


def _template_fields(fields: Mapping[str, object] | None) -> dict[str, Any]:
    out: dict[str, Any] = dict(fields or {})
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [_decoded_arguments(call) for call in calls]
    return out


def _decoded_arguments(call: object) -> object:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    function = dict(call["function"])
    try:
        function["arguments"] = json.loads(function.get("arguments") or "{}")
    except ValueError:
        raise _invalid("a tool call's arguments are not JSON") from None
    return {**call, "function": function}


def _apply_template(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    template: str | None,
    template_options: Mapping[str, object],
) -> str:
    if tokenizer is None:
        raise EngineError(ErrorCode.ENGINE_ERROR, "this vLLM engine has no tokenizer for chats")
    if template is None and getattr(tokenizer, "chat_template", "") is None:
        raise EngineError(
            ErrorCode.ENGINE_ERROR,
            "the model has no chat template; start the worker with --chat-template",
        )
    # vLLM 0.32's server lays the request's own fields over ``chat_template_kwargs``
    # (``merge_kwargs``): a key of both is the field's, even when only its default was sent.
    kwargs = template_options.get("chat_template_kwargs")
    options: dict[str, Any] = dict(kwargs) if isinstance(kwargs, dict) else {}
    options["add_generation_prompt"] = template_options.get("add_generation_prompt", True)
    if "continue_final_message" in template_options or "continue_final_message" in options:
        options["continue_final_message"] = template_options.get("continue_final_message", False)
    options["tokenize"] = False
    if template is not None:
        options["chat_template"] = template
    try:
        text = tokenizer.apply_chat_template(conversation, **options)
    except Exception as exc:  # Jinja errors, raise_exception() in templates
        raise _invalid(f"the chat template refused the messages: {exc}") from None
    if not isinstance(text, str):
        raise EngineError(ErrorCode.ENGINE_ERROR, "the chat template did not render to text")
    return text


def render_prompt(
    prompt: Prompt,
    media: Sequence[MediaItem],
    *,
    tokenizer: Any,
    chat_template: str | None = None,
    decode_media: MediaDecoder = decode_media_item,
    options: Mapping[str, object] | None = None,
) -> RenderedPrompt:
    """Turn a request's prompt and media into a vLLM prompt.

    Token ids pass through; text passes through (it must already hold the
    model's media placeholders, if any); chat messages go through the chat
    template with a placeholder where each media part is, and are tokenized
    without extra special tokens (the template has them).  Each distinct media
    item (by content hash) is decoded once; ``multi_modal_data`` lists the
    decoded items per modality in placeholder order.  The request's template
    options (``chat_template_kwargs``, ``add_generation_prompt``,
    ``continue_final_message``) go to the template as vLLM's server passes them;
    ``mm_processor_kwargs`` go on the prompt, for the model's processor.

    Raises:
        EngineError: ``invalid_request`` for bad media references, undecodable
            media or a template refusal; ``engine_error`` without a template.
    """
    tokenization: dict[str, Any] | None = None
    if prompt.messages is not None:
        conversation, order = _conversation(prompt.messages, media)
        text = _apply_template(tokenizer, conversation, chat_template, options or {})
        inputs: dict[str, Any] = {"prompt": text}
        tokenization = {"add_special_tokens": False}
    else:
        order = list(range(len(media)))
        if prompt.token_ids is not None:
            inputs = {"prompt_token_ids": list(prompt.token_ids)}
        else:
            inputs = {"prompt": prompt.text}
    if order:
        decoded: dict[str, object] = {}
        multi_modal: dict[str, list[object]] = {}
        for index in order:
            item = media[index]
            if item.content_hash not in decoded:
                decoded[item.content_hash] = decode_media(item)
            multi_modal.setdefault(item.modality, []).append(decoded[item.content_hash])
        inputs["multi_modal_data"] = multi_modal
    processor = (options or {}).get("mm_processor_kwargs")
    if isinstance(processor, dict) and processor:
        inputs["mm_processor_kwargs"] = dict(processor)
    return RenderedPrompt(inputs, tokenization)


def wire_params(params: Mapping[str, Any] | None, what: str) -> dict[str, object] | None:
    """vLLM's transfer params as plain JSON-like data (what the wire codec carries).

    Raises:
        EngineError: ``engine_error`` when they are not JSON-like.
    """
    if params is None:
        return None
    try:
        plain = json.loads(json.dumps(params))
    except (TypeError, ValueError) as exc:
        raise EngineError(
            ErrorCode.ENGINE_ERROR, f"vLLM's {what} are not plain data: {exc}"
        ) from None
    if not isinstance(plain, dict):
        raise EngineError(ErrorCode.ENGINE_ERROR, f"vLLM's {what} are not a mapping")
    return plain


def check_finish(reason: str | None, vllm_id: str) -> None:
    """Refuse an output vLLM finished without completing it (``abort``, ``error``).

    Raises:
        EngineError: ``engine_error``, retryable.
    """
    if reason in FAILED_FINISH_REASONS:
        raise EngineError(
            ErrorCode.ENGINE_ERROR,
            f"vLLM finished request {vllm_id} with {reason!r}",
            retryable=True,
        )


@dataclass(slots=True)
class _TokenLogprobs:
    """The log-probability parts of a run of sampled tokens: what a ``Delta`` carries.

    ``tokens`` and ``top`` stay lists only while every token had them (vLLM
    gives each candidate's ``decoded_token`` when it detokenizes); a token
    without one turns them to None, as the ``Delta`` invariants want.
    """

    values: list[float]
    tokens: list[str] | None
    top: list[tuple[TokenLogprob, ...]] | None

    def extend(self, output: CompletionOutputLike, alternatives: int) -> bool:
        """Add ``output``'s tokens; False when vLLM gave no logprobs for them."""
        entries = output.logprobs
        token_ids = list(output.token_ids)
        if entries is None or len(entries) != len(token_ids):
            return False
        for entry, token_id in zip(entries, token_ids, strict=True):
            found = entry[token_id]
            self.values.append(float(getattr(found, "logprob", found)))
            text = getattr(found, "decoded_token", None)
            if self.tokens is not None:
                self.tokens = [*self.tokens, text] if isinstance(text, str) else None
            if self.top is not None:
                self.top = _with_alternatives(self.top, entry, alternatives)
        return True


def _with_alternatives(
    top: list[tuple[TokenLogprob, ...]], entry: Mapping[int, Any], alternatives: int
) -> list[tuple[TokenLogprob, ...]] | None:
    """``top`` plus one token's first ``alternatives`` candidates, in vLLM's order.

    vLLM's OpenAI server lists a position's candidates in the order of its
    logprobs dictionary (the sampled token, then the most likely ones) and
    stops at ``top_logprobs``; a candidate without its text makes it None.
    """
    candidates: list[TokenLogprob] = []
    for candidate in list(entry.values())[:alternatives]:
        text = getattr(candidate, "decoded_token", None)
        if not isinstance(text, str):
            return None
        candidates.append(TokenLogprob(text, float(candidate.logprob)))
    top.append(tuple(candidates))
    return top


class StreamAccumulator:
    """Turns one generate request's ``DELTA``-mode outputs into deltas.

    Args:
        request_id: stamped on the deltas.
        want_logprobs: whether the request asked for logprobs.
        start: when the request started (``trio.current_time()``), for timings.
    """

    __slots__ = (
        "alternatives",
        "completion_tokens",
        "finish_reason",
        "first_at",
        "prompt_tokens",
        "request_id",
        "start",
        "want_logprobs",
    )

    def __init__(
        self, request_id: str, *, want_logprobs: bool, start: float, alternatives: int = 0
    ) -> None:
        self.request_id = request_id
        self.want_logprobs = want_logprobs
        self.alternatives = alternatives
        self.start = start
        self.completion_tokens = 0
        self.prompt_tokens = 0
        self.finish_reason: str | None = None
        self.first_at: float | None = None

    def take(self, outputs: Sequence[RequestOutputLike], now: float) -> Delta | None:
        """Merge a batch of outputs into one delta; None when it holds nothing new.

        Once an output is finished, :attr:`finish_reason` is set and the delta
        returned is the terminal one (``finish_reason``, ``usage``, timings).
        """
        token_ids: list[int] = []
        texts: list[str] = []
        logprobs = _TokenLogprobs([], [], [] if self.alternatives else None)
        complete = self.want_logprobs
        for output in outputs:
            if output.prompt_token_ids is not None:
                self.prompt_tokens = len(output.prompt_token_ids)
            completion = output.outputs[0] if output.outputs else None
            if output.finished:
                reason = completion.finish_reason if completion is not None else None
                self.finish_reason = reason or "stop"
            if completion is None:
                continue
            token_ids.extend(completion.token_ids)
            texts.append(completion.text)
            if complete:
                complete = logprobs.extend(completion, self.alternatives)
        self.completion_tokens += len(token_ids)
        delta = Delta(
            self.request_id,
            token_ids=tuple(token_ids),
            text="".join(texts),
            logprobs=tuple(logprobs.values) if complete else None,
            tokens=tuple(logprobs.tokens) if complete and logprobs.tokens is not None else None,
            top_logprobs=tuple(logprobs.top) if complete and logprobs.top is not None else None,
        )
        if self.finish_reason is not None:
            return self._terminal(delta, now)
        if not token_ids and not delta.text:
            return None
        if self.first_at is None:
            self.first_at = now
        return delta

    def _terminal(self, delta: Delta, now: float) -> Delta:
        first_at = self.first_at if self.first_at is not None else now
        return replace(
            delta,
            finish_reason=self.finish_reason,
            usage=Usage(self.prompt_tokens, self.completion_tokens),
            timings={
                "ttft_s": first_at - self.start,
                "decode_s": now - first_at,
                "total_s": now - self.start,
            },
        )
