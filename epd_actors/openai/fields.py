"""Every field of vLLM's OpenAI request bodies, and what the router does with it; pure.

Theory of operation
-------------------
The rule (docs/http.md, "Request fields"): each field of a
``/v1/chat/completions`` or ``/v1/completions`` body, vLLM's extra parameters
included, either reaches the engine with the same effect it has on a plain
``vllm serve``, or is refused with 400 and ``param`` naming it.  Nothing is
dropped.  This module holds the table that says which:

* **router fields** (:data:`ROUTER_FIELDS`) are read by
  :mod:`epd_actors.openai.schema` itself -- the prompt, ``model``, ``stream``, the
  token limit, the sampling fields the router's own types carry -- and reach
  the engine through those types;
* **engine fields** (:data:`ENGINE_FIELDS`) are checked for shape here and
  carried to the engine verbatim in the request's ``options`` (the HTTP
  backend puts them in the body it sends, a native worker's engine applies
  them or refuses the request naming the field);
* **refused fields** (:data:`REFUSED_FIELDS`) change the answer in a way the
  router cannot deliver (``n > 1``, ``best_of > 1``, beam search, prompt
  log-probabilities), or belong to the router (``kv_transfer_params``): a
  value other than the harmless one is refused, saying why;
* anything else is **unknown**: refused by default (``unknown_parameter``),
  or, with ``unknown_fields = "forward"``, carried in ``options`` unchecked,
  for an engine newer than this table.

A JSON ``null`` means "not set" for every field, so it is skipped, never
forwarded: it changes nothing.  Checks are shapes and bounds only; the
engine still validates meaning (a JSON schema, a grammar) and its refusal
reaches the client with the field it named.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final, Literal

from ..errors import InvalidRequest

RequestKind = Literal["chat", "completion"]
UnknownFields = Literal["reject", "forward", "ignore"]
UNKNOWN_FIELD_CHOICES: Final = ("reject", "forward")
"""What a router may be configured with: it never drops a client's field silently.

``ignore`` (accept and drop, as vLLM's own request models do) is for the
simulator's ``vllm serve`` double only."""
Check = Callable[[object, str], object]
"""Checks a field's value (its dotted name given for errors) and returns what to forward."""

MAX_TOKEN_LIST: Final = 65_536
"""Entries of a token-id list (``stop_token_ids``, ``allowed_token_ids``)."""

MAX_LOGIT_BIAS: Final = 4_096
"""Entries of ``logit_bias``."""

MAX_STRINGS: Final = 1_024
"""Entries of a list of strings (``bad_words``, ``guided_choice``)."""

MAX_TOOLS: Final = 1_024
"""Entries of ``tools``."""

_TOKEN_ID_LIMIT: Final = 1 << 31

BOTH: Final[frozenset[RequestKind]] = frozenset({"chat", "completion"})
CHAT: Final[frozenset[RequestKind]] = frozenset({"chat"})
COMPLETION: Final[frozenset[RequestKind]] = frozenset({"completion"})


# ---------------------------------------------------------------- checks


def number(low: float = -math.inf, high: float = math.inf, *, open_low: bool = False) -> Check:
    """A finite JSON number in ``[low, high]`` (``(low, high]`` with ``open_low``)."""

    def check(value: object, param: str) -> object:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidRequest(f"{param} must be a number", param=param)
        below = value <= low if open_low else value < low
        if not math.isfinite(value) or below or value > high:
            opener = "(" if open_low else "["
            raise InvalidRequest(f"{param} must be in {opener}{low:g}, {high:g}]", param=param)
        return value

    return check


def integer(low: int, high: int) -> Check:
    """A JSON integer in ``[low, high]``."""

    def check(value: object, param: str) -> object:
        if type(value) is not int or not low <= value <= high:
            raise InvalidRequest(f"{param} must be an integer in [{low}, {high}]", param=param)
        return value

    return check


def of_type(kinds: type | tuple[type, ...], what: str) -> Check:
    """A JSON value of one of the Python ``kinds`` (``bool`` is not taken for a number)."""

    def check(value: object, param: str) -> object:
        if not isinstance(value, kinds):
            raise InvalidRequest(f"{param} must be {what}", param=param)
        return value

    return check


boolean: Final = of_type(bool, "true or false")
string: Final = of_type(str, "a string")
json_object: Final = of_type(dict, "a JSON object")
"""Any JSON object (the engine checks what is inside)."""
string_or_object: Final = of_type((str, dict), "a string or a JSON object")
"""A JSON string or object (a JSON schema given either way)."""


def list_of(item: Check, max_items: int, *, min_items: int = 0) -> Check:
    """A JSON array of ``min_items`` to ``max_items`` values, each passing ``item``."""

    def check(value: object, param: str) -> object:
        if not isinstance(value, list) or not min_items <= len(value) <= max_items:
            raise InvalidRequest(
                f"{param} must be an array of {min_items} to {max_items} entries", param=param
            )
        for index, entry in enumerate(value):
            item(entry, f"{param}[{index}]")
        return value

    return check


token_id = integer(0, _TOKEN_ID_LIMIT - 1)


def logit_bias(value: object, param: str) -> object:
    """A map of token ids (as strings, OpenAI's form) to biases in [-100, 100]."""
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise InvalidRequest(
            f"{param} must be an object of at most {MAX_LOGIT_BIAS} entries", param=param
        )
    bias = number(-100.0, 100.0)
    for key, entry in value.items():
        if not key.isdigit() or int(key) >= _TOKEN_ID_LIMIT:
            raise InvalidRequest(f"{param} keys must be token ids, got {key!r}", param=param)
        bias(entry, f"{param}.{key}")
    return value


def one_of(*choices: str) -> Check:
    """One of the given strings."""

    def check(value: object, param: str) -> object:
        if value not in choices:
            raise InvalidRequest(f"{param} must be one of {', '.join(choices)}", param=param)
        return value

    return check


def response_format(value: object, param: str) -> object:
    """OpenAI's ``response_format``: text, json_object, json_schema (or vLLM's structural_tag)."""
    fields = json_object(value, param)
    assert isinstance(fields, dict)
    kind = fields.get("type")
    one_of("text", "json_object", "json_schema", "structural_tag")(kind, f"{param}.type")
    if kind == "json_schema":
        schema = fields.get("json_schema")
        json_object(schema, f"{param}.json_schema")
        assert isinstance(schema, dict)
        if "schema" in schema and not isinstance(schema["schema"], dict | bool):
            raise InvalidRequest(
                f"{param}.json_schema.schema must be a JSON schema object",
                param=f"{param}.json_schema.schema",
            )
    return value


def _function(value: object, param: str) -> dict[str, object]:
    """``{"type": "function", "function": {...}}``: its ``function`` object, checked for shape."""
    fields = json_object(value, param)
    assert isinstance(fields, dict)
    one_of("function")(fields.get("type"), f"{param}.type")
    function = json_object(fields.get("function"), f"{param}.function")
    assert isinstance(function, dict)
    return function


def tool(value: object, param: str) -> object:
    """One entry of ``tools``: ``{"type": "function", "function": {"name", ...}}``."""
    function = _function(value, param)
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(
            f"{param}.function.name must be a non-empty string", param=f"{param}.function.name"
        )
    parameters = function.get("parameters")
    if parameters is not None:
        json_object(parameters, f"{param}.function.parameters")
    return value


def tool_choice(value: object, param: str) -> object:
    """``none``, ``auto``, ``required``, or ``{"type": "function", "function": {"name"}}``."""
    if isinstance(value, str):
        return one_of("none", "auto", "required")(value, param)
    string(_function(value, param).get("name"), f"{param}.function.name")
    return value


# ---------------------------------------------------------------- the table


@dataclass(frozen=True, slots=True)
class EngineField:
    """A field carried to the engine in ``options``.

    Attributes:
        check: its shape check.
        kinds: the endpoints that take it.
    """

    check: Check
    kinds: frozenset[RequestKind] = BOTH


@dataclass(frozen=True, slots=True)
class RefusedField:
    """A field the router refuses unless it holds its harmless value.

    Attributes:
        reason: why, for the error message.
        harmless: values accepted (and then dropped, since they change nothing).
    """

    reason: str
    harmless: tuple[object, ...] = ()


ROUTER_FIELDS: Final[Mapping[RequestKind, frozenset[str]]] = {
    "chat": frozenset(
        {
            "messages", "model", "stream", "stream_options", "n", "user",
            "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
            "seed", "stop", "min_tokens", "logprobs", "top_logprobs",
        }
    ),
    "completion": frozenset(
        {
            "prompt", "model", "stream", "stream_options", "n", "user", "max_tokens",
            "temperature", "top_p", "top_k", "seed", "stop", "min_tokens", "logprobs",
        }
    ),
}  # fmt: skip
"""Read by :mod:`epd_actors.openai.schema` into the router's own types."""

_PENALTY: Final = number(-2.0, 2.0)

ENGINE_FIELDS: Final[Mapping[str, EngineField]] = {
    # sampling (vLLM's SamplingParams)
    "frequency_penalty": EngineField(_PENALTY),
    "presence_penalty": EngineField(_PENALTY),
    "repetition_penalty": EngineField(number(0.0, math.inf, open_low=True)),
    "length_penalty": EngineField(number()),
    "logit_bias": EngineField(logit_bias),
    "min_p": EngineField(number(0.0, 1.0)),
    "ignore_eos": EngineField(boolean),
    "stop_token_ids": EngineField(list_of(token_id, MAX_TOKEN_LIST)),
    "allowed_token_ids": EngineField(list_of(token_id, MAX_TOKEN_LIST, min_items=1)),
    "bad_words": EngineField(list_of(string, MAX_STRINGS)),
    "include_stop_str_in_output": EngineField(boolean),
    "skip_special_tokens": EngineField(boolean),
    "spaces_between_special_tokens": EngineField(boolean),
    "truncate_prompt_tokens": EngineField(integer(-1, _TOKEN_ID_LIMIT)),
    "vllm_xargs": EngineField(json_object),
    "logits_processors": EngineField(list_of(string_or_object, MAX_STRINGS)),
    # structured outputs
    "response_format": EngineField(response_format),
    "structured_outputs": EngineField(json_object),
    "guided_json": EngineField(string_or_object),
    "guided_regex": EngineField(string),
    "guided_choice": EngineField(list_of(string, MAX_STRINGS, min_items=1)),
    "guided_grammar": EngineField(string),
    "structural_tag": EngineField(string),
    "guided_decoding_backend": EngineField(string),
    "guided_whitespace_pattern": EngineField(string),
    # tools and reasoning
    "tools": EngineField(list_of(tool, MAX_TOOLS), CHAT),
    "tool_choice": EngineField(tool_choice, CHAT),
    "parallel_tool_calls": EngineField(boolean, CHAT),
    "reasoning_effort": EngineField(one_of("minimal", "low", "medium", "high"), CHAT),
    "include_reasoning": EngineField(boolean, CHAT),
    # prompt rendering
    "echo": EngineField(boolean),
    "add_generation_prompt": EngineField(boolean, CHAT),
    "continue_final_message": EngineField(boolean, CHAT),
    "add_special_tokens": EngineField(boolean),
    "chat_template": EngineField(string, CHAT),
    "chat_template_kwargs": EngineField(json_object, CHAT),
    "documents": EngineField(list_of(json_object, MAX_STRINGS), CHAT),
    "mm_processor_kwargs": EngineField(json_object, CHAT),
    "media_io_kwargs": EngineField(json_object, CHAT),
    # output shape and scheduling
    "return_tokens_as_token_ids": EngineField(boolean),
    "priority": EngineField(integer(-(1 << 31), (1 << 31) - 1)),
    "cache_salt": EngineField(string),
}
"""Checked here, carried verbatim to the engine (``options``)."""

REFUSED_FIELDS: Final[Mapping[str, RefusedField]] = {
    "best_of": RefusedField("best_of > 1 is not supported: send one request per choice", (1,)),
    "use_beam_search": RefusedField("beam search is not supported through the router", (False,)),
    "suffix": RefusedField("suffix is not supported (vLLM does not support it either)", ("",)),
    "prompt_logprobs": RefusedField("prompt log-probabilities are not relayed by the router"),
    "prompt_embeds": RefusedField("prompt embeddings are not supported through the router"),
    "return_token_ids": RefusedField("token ids in responses are not relayed", (False,)),
    "functions": RefusedField("functions is deprecated: use tools", ([],)),
    "function_call": RefusedField("function_call is deprecated: use tool_choice"),
    "kv_transfer_params": RefusedField("kv_transfer_params is set by the router, not the client"),
    "ec_transfer_params": RefusedField("ec_transfer_params is set by the router, not the client"),
    "request_id": RefusedField("send the request id in the x-request-id header"),
}
"""Refused, with the reason, unless the value is harmless."""

TRANSFER_FIELDS: Final = frozenset({"kv_transfer_params", "ec_transfer_params", "return_token_ids"})
"""What a router sends a vLLM server on top of the client's body; a worker accepts them."""


@dataclass(frozen=True, slots=True)
class FieldPolicy:
    """How a parser treats fields outside the router's own.

    Attributes:
        unknown: ``reject`` (400 ``unknown_parameter``), ``forward`` (carried
            unchecked in ``options``) or ``ignore`` (dropped: vLLM's behaviour,
            for its double; never a router's).
        accept_transfer_fields: take :data:`TRANSFER_FIELDS` into ``options``
            (a worker's parser: the router sends them).
    """

    unknown: UnknownFields = "reject"
    accept_transfer_fields: bool = False


STRICT_FIELDS: Final = FieldPolicy()
"""The default: unknown fields refused, transfer fields refused."""


def engine_options(
    fields: Mapping[str, object], kind: RequestKind, policy: FieldPolicy
) -> dict[str, object]:
    """The body's fields for the engine, checked; refuses what cannot be honoured.

    Args:
        fields: the whole request body.
        kind: which endpoint it came to.
        policy: what to do with unknown and transfer fields.

    Returns:
        The engine fields that are set, by name (empty when none are).

    Raises:
        InvalidRequest: a field of the wrong shape, a refused value, a field of
            the other endpoint, or an unknown field under ``reject``;
            ``param`` names it.
    """
    own = ROUTER_FIELDS[kind]
    options: dict[str, object] = {}
    for name, value in fields.items():
        if value is None or name in own:
            continue
        engine = ENGINE_FIELDS.get(name)
        if engine is not None:
            if kind not in engine.kinds:
                raise InvalidRequest(f"{name} is not a {kind} request field", param=name)
            options[name] = engine.check(value, name)
        elif policy.accept_transfer_fields and name in TRANSFER_FIELDS:
            options[name] = value
        elif name in REFUSED_FIELDS:
            _refuse(name, value, REFUSED_FIELDS[name])
        elif policy.unknown == "forward":
            options[name] = value
        elif policy.unknown == "ignore":
            continue
        else:
            raise InvalidRequest(
                f"unknown parameter {name!r}: this router neither knows nor forwards it "
                '(a router started with unknown_fields = "forward" passes such fields on)',
                param=name,
                code="unknown_parameter",
            )
    return options


def _refuse(name: str, value: object, rule: RefusedField) -> None:
    if any(type(value) is type(ok) and value == ok for ok in rule.harmless):
        return
    raise InvalidRequest(rule.reason, param=name)
