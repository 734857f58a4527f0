"""The parameter matrix: every request field of the API-fidelity rule, through a router and plain.

Theory of operation
-------------------
The rule (docs/http.md, "Request fields") says that every field of an OpenAI
body either has the same effect through the router as on a plain engine, or
is refused with 400 and ``param`` naming it.  This module checks it from
the outside, by HTTP, against any pair of endpoints: a **router** and a
**plain** engine of the same model.  The lane points it at a router over real
vLLM engines and at a plain ``vllm serve``; the main suite points it at a
router over the simulator's vLLM HTTP double and at that double itself.

1. A **probe** (the baseline request plus ``return_token_ids``) goes to the
   plain engine only; the cases that need the answer's own tokens (a stop
   string, a stop token, a banned word, a biased token) are built from it,
   so that each of them changes the answer by construction
   (:func:`build_cases`).
2. Each :class:`Case` goes to the plain engine, then to the router.  When
   the engine behind the router is known not to honour one of the case's
   fields (:attr:`Profile.refuses`), the router must answer 400 naming the
   first such field of the body; otherwise its answer must equal the plain
   one: text, finish reason, usage, tool calls, and token by token the
   sampled tokens and their log-probabilities and alternatives, within
   :data:`LOGPROB_TOLERANCE` (:func:`differences`).
3. A comparison only proves that a field is forwarded if the field changes
   the answer.  So the plain answer of every case must differ from the plain
   answer of its :attr:`Case.reference` (the same request without the field),
   unless the profile lists the field as having no effect on that engine
   (:attr:`Profile.inert`); a case whose field changed nothing is a failure.
4. Constrained outputs are checked for what they promise: a JSON answer
   against its schema (in a Python that has ``jsonschema``: the lane's
   virtualenv), a choice, a regex, a grammar, a forced tool call parsed with
   the official ``openai`` client's types.

Nothing here starts a process; the callers own the endpoints.  Requests are
plain synchronous ``httpx`` calls, so the main suite runs :func:`run_matrix`
in a thread next to its Trio servers.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from openai.types.chat import ChatCompletion
from pydantic import ValidationError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

    import httpx

    Validator = Callable[[object, object], list[str]]
    """Checks a JSON value against a JSON schema; returns the problems found (none: valid)."""

LOGPROB_TOLERANCE = 2e-3
"""Log-probabilities may differ this much (float32 kernels may round differently)."""

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PROMPT = "The quick brown fox jumps over the lazy dog. " * 2
MAX_TOKENS = 8
CONSTRAINED_TOKENS = 32
"""Room for a constrained answer (a JSON object, a tool call) to finish."""
REQUIRED_TOKENS = 128
"""Room for ``tool_choice: required``'s answer: a JSON list of calls with their names."""

SEED = 1234
OTHER_SEED = 4321
BIAS_FORCE = 100
"""A logit bias that makes its token the only choice."""
BIAS_PAIR = (10, 9)
"""Biases of two tokens A and B: A wins every step unless a penalty of more than one logit
(A was already generated) lets B win.  The tiny models' logits spread far less than one."""
PENALTY = 2.0
FLAG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"flag": {"type": "boolean"}},
    "required": ["flag"],
    "additionalProperties": False,
}
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
}
CHOICES = ["yes", "no"]
REGEX = "[a-c]{3}"
GRAMMAR = 'root ::= "yes" | "no"'
ASSISTANT_PREFIX = "The quick"


# ---------------------------------------------------------------- replies


@dataclass(frozen=True)
class Reply:
    """An HTTP answer: its status and its JSON body (``{}`` when it had none)."""

    status: int
    body: dict[str, Any]

    @property
    def error_param(self) -> str | None:
        error = self.body.get("error")
        return error.get("param") if isinstance(error, dict) else None

    def choice(self) -> dict[str, Any]:
        choices = self.body.get("choices") or [{}]
        first: dict[str, Any] = choices[0]
        return first


def post(client: httpx.Client, base_url: str, path: str, body: Mapping[str, Any]) -> Reply:
    """POST ``body`` as JSON; any status is a :class:`Reply` (transport errors raise)."""
    response = client.post(f"{base_url}{path}", json=dict(body))
    try:
        parsed = response.json()
    except ValueError:
        parsed = {"text": response.text[:500]}
    return Reply(response.status_code, parsed if isinstance(parsed, dict) else {"body": parsed})


# ---------------------------------------------------------------- answers, compared


def answer_view(reply: Reply) -> dict[str, Any]:
    """What a client reads of a completion: everything but ids, timestamps and extensions.

    The text, the finish reason, the usage counts, the tool calls (name, type and
    arguments; their ids are random) and, per sampled token, its text, its
    log-probability and its alternatives.  A JSON ``null`` and a missing key read
    the same.
    """
    choice = reply.choice()
    message = choice.get("message") or {}
    usage = reply.body.get("usage") or {}
    return {
        "text": message.get("content") if "message" in choice else choice.get("text"),
        "reasoning": message.get("reasoning_content") or message.get("reasoning"),
        "tool_calls": [_tool_call_view(call) for call in message.get("tool_calls") or []],
        "finish_reason": choice.get("finish_reason"),
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "logprobs": _logprobs_view(choice.get("logprobs")),
    }


def _tool_call_view(call: Mapping[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    return {
        "type": call.get("type"),
        "name": function.get("name"),
        "arguments": function.get("arguments"),
    }


def _logprobs_view(logprobs: Mapping[str, Any] | None) -> list[dict[str, Any]] | None:
    """Per sampled token: ``token``, ``logprob``, ``top`` (its alternatives), for both shapes."""
    if not logprobs:
        return None
    if "content" in logprobs:  # chat
        return [
            {
                "token": entry.get("token"),
                "logprob": entry.get("logprob"),
                "top": [
                    (alt.get("token"), alt.get("logprob"))
                    for alt in entry.get("top_logprobs") or []
                ],
            }
            for entry in logprobs.get("content") or []
        ]
    tokens = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or [None] * len(tokens)
    tops = logprobs.get("top_logprobs") or [None] * len(tokens)
    return [
        {"token": token, "logprob": value, "top": sorted((top or {}).items())}
        for token, value, top in zip(tokens, values, tops, strict=False)
    ]


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def differences(
    want: object, got: object, *, tolerance: float = LOGPROB_TOLERANCE, where: str = ""
) -> list[str]:
    """Where ``got`` differs from ``want`` (JSON-like values), floats within ``tolerance``.

    Returns one line per difference, naming its path (``logprobs[3].top[0]``);
    empty when they are equal.
    """
    if _is_number(want) and _is_number(got) and float in (type(want), type(got)):
        if abs(float(want) - float(got)) <= tolerance:  # type: ignore[arg-type]
            return []
        return [f"{where}: {got!r} != {want!r} (within {tolerance} expected)"]
    if isinstance(want, dict) and isinstance(got, dict):
        found: list[str] = []
        for key in sorted(set(want) | set(got), key=str):
            found += differences(
                want.get(key), got.get(key), tolerance=tolerance, where=f"{where}.{key}".lstrip(".")
            )
        return found
    if isinstance(want, list | tuple) and isinstance(got, list | tuple):
        if len(want) != len(got):
            return [f"{where}: {len(got)} entries != {len(want)}: {got!r} != {want!r}"]
        found = []
        for index, (a, b) in enumerate(zip(want, got, strict=True)):
            found += differences(a, b, tolerance=tolerance, where=f"{where}[{index}]")
        return found
    return [] if want == got else [f"{where or '.'}: {got!r} != {want!r}"]


# ---------------------------------------------------------------- what an engine honours


@dataclass(frozen=True)
class Profile:
    """What the engines behind a router do with the matrix's fields.

    Attributes:
        name: for messages (``vllm via openai_http``).
        refuses: fields the engine does not honour: the router must answer 400
            naming the first of them in the body.
        inert: fields the engine accepts but that change nothing on it (the
            simulator ignores ``top_k``): their cases are compared, but not
            required to change the answer.
        json_checks: whether constrained answers are checked (needs a
            ``jsonschema`` validator).
    """

    name: str
    refuses: frozenset[str] = frozenset()
    inert: frozenset[str] = frozenset()
    json_checks: bool = True

    def expected_refusal(self, body: Mapping[str, Any]) -> str | None:
        """The field the router must name refusing ``body``; None when it must answer."""
        return next((name for name in body if name in self.refuses), None)


# ---------------------------------------------------------------- cases


@dataclass(frozen=True)
class Model:
    """The model the matrix runs on: its served name and two special tokens."""

    name: str
    eos_token_id: int
    special_token_id: int
    """A special token other than EOS (not in the text unless ``skip_special_tokens`` is false)."""


@dataclass(frozen=True)
class Facts:
    """What the plain engine answered to the probe: the baseline's text and token ids."""

    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Case:
    """One request of the matrix.

    Attributes:
        name: readable id.
        fields: the fields under test, added to (or replacing) the base body.
        reference: the case whose plain answer this one must differ from.
        path: the endpoint.
        base: the base body's fields (``chat_base`` or ``completion_base``).
        check: what a constrained answer must satisfy (a validator is passed for JSON).
    """

    name: str
    fields: dict[str, Any]
    reference: str | None = "baseline"
    path: str = CHAT
    base: Callable[[Model], dict[str, Any]] | None = None
    check: Callable[[Reply, Validator], list[str]] | None = None

    def body(self, model: Model) -> dict[str, Any]:
        base = (self.base or chat_base)(model)
        return {**base, **self.fields}


def chat_base(model: Model) -> dict[str, Any]:
    return {
        "model": model.name,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": True,
    }


def completion_base(model: Model) -> dict[str, Any]:
    return {
        "model": model.name,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": 2,
    }


def assistant_turn_base(model: Model) -> dict[str, Any]:
    messages = [
        {"role": "user", "content": PROMPT},
        {"role": "assistant", "content": ASSISTANT_PREFIX},
    ]
    return {**chat_base(model), "messages": messages, "add_generation_prompt": False}


PROBE = Case("baseline", {}, reference=None)


def probe_body(model: Model) -> dict[str, Any]:
    """The baseline request, asking the plain engine for its token ids too."""
    return {**PROBE.body(model), "return_token_ids": True}


def facts_of(reply: Reply) -> Facts:
    """The probe's answer as :class:`Facts`.

    Raises:
        AssertionError: the probe failed, or its answer has no token ids or too
            few tokens to build the cases from.
    """
    assert reply.status == 200, f"the plain engine refused the probe: {reply.body}"
    choice = reply.choice()
    ids = choice.get("token_ids")
    assert isinstance(ids, list), f"the plain engine returned no token_ids: {choice}"
    text = (choice.get("message") or {}).get("content") or ""
    assert len(ids) >= 4, f"the baseline is too short to build the matrix from: {ids}"
    return Facts(text, tuple(ids))


def stop_string(text: str) -> str:
    """A stop string from the middle of ``text``, so that stopping there shortens it.

    A whole word when the text has three or more; else one visible character.

    Raises:
        AssertionError: the text has nothing visible to stop at.
    """
    words = [w for w in text.split() if w.isprintable() and "\ufffd" not in w]
    if len(words) >= 3:
        return words[len(words) // 2]
    middle = text[len(text) // 3 :] + text[: len(text) // 3]
    visible = [c for c in middle if c.isprintable() and not c.isspace() and c != "\ufffd"]
    assert visible, f"the baseline text has no visible character to stop at: {text!r}"
    return visible[0]


def banned_word(text: str) -> str:
    """The baseline's first visible word (``bad_words`` takes words, not ids)."""
    words = [w for w in text.split() if w.isprintable() and "\ufffd" not in w]
    assert words, f"the baseline text has no word to ban: {text!r}"
    return words[0]


def bias_pair(facts: Facts) -> tuple[int, int]:
    """Two distinct token ids: the baseline's first, and another one it generated."""
    first = facts.token_ids[0]
    other = next((t for t in facts.token_ids if t != first), first + 1)
    return first, other


def build_cases(model: Model, facts: Facts) -> list[Case]:
    """The matrix, its effects guaranteed by construction from the probe's answer."""
    stop = stop_string(facts.text)
    a, b = bias_pair(facts)
    pair = {"logit_bias": {str(a): BIAS_PAIR[0], str(b): BIAS_PAIR[1]}}
    seeded = {"temperature": 1.0, "seed": SEED}
    eos = {"logit_bias": {str(model.eos_token_id): BIAS_FORCE}}
    special = {"logit_bias": {str(model.special_token_id): BIAS_FORCE}}
    structured = {"max_tokens": CONSTRAINED_TOKENS}
    return [
        PROBE,
        Case("completion", {}, reference=None, path=COMPLETIONS, base=completion_base),
        Case("echo", {"echo": True, "logprobs": None}, "completion", COMPLETIONS, completion_base),
        # seeded sampling and the router's own sampling fields
        Case("seeded", seeded),
        Case("seeded_other", {**seeded, "seed": OTHER_SEED}, "seeded"),
        Case("top_k", {**seeded, "top_k": 1}, "seeded"),
        Case("top_p", {**seeded, "top_p": 0.01}, "seeded"),
        Case("min_p", {**seeded, "min_p": 0.95}, "seeded"),
        Case("top_logprobs", {"top_logprobs": 3}),
        # stopping
        Case("stop", {"stop": [stop]}),
        Case(
            "include_stop_str_in_output",
            {"stop": [stop], "include_stop_str_in_output": True},
            "stop",
        ),
        Case("min_tokens", {"stop": [stop], "min_tokens": MAX_TOKENS}, "stop"),
        Case("stop_token_ids", {"stop_token_ids": [facts.token_ids[MAX_TOKENS // 2]]}),
        Case("eos_forced", eos),
        Case("ignore_eos", {"ignore_eos": True, **eos}, "eos_forced"),
        # the logits
        Case("logit_bias", {"logit_bias": {str(b): BIAS_FORCE}}),
        Case("bad_words", {"bad_words": [banned_word(facts.text)]}),
        Case("bias_pair", pair),
        Case("frequency_penalty", {"frequency_penalty": PENALTY, **pair}, "bias_pair"),
        Case("presence_penalty", {"presence_penalty": PENALTY, **pair}, "bias_pair"),
        Case("repetition_penalty", {"repetition_penalty": PENALTY, **pair}, "bias_pair"),
        Case("special_forced", special),
        Case("skip_special_tokens", {"skip_special_tokens": False, **special}, "special_forced"),
        # the chat template
        # A variable the tiny Llama's template reads: vLLM 0.32 lays the request's own fields
        # (add_generation_prompt...) over chat_template_kwargs, so those cannot show it.
        Case("chat_template_kwargs", {"chat_template_kwargs": {"preamble": "Answer in one word."}}),
        Case("add_generation_prompt", {"add_generation_prompt": False}),
        Case("assistant_turn", {}, base=assistant_turn_base),
        Case(
            "continue_final_message",
            {"continue_final_message": True},
            "assistant_turn",
            base=assistant_turn_base,
        ),
        # structured outputs
        Case("json_object", {"response_format": {"type": "json_object"}, **structured}),
        Case(
            "json_schema",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "flag", "schema": FLAG_SCHEMA},
                },
                **structured,
            },
            check=json_answer(FLAG_SCHEMA, must_finish=False),
        ),
        Case(
            "structured_json",
            {
                "structured_outputs": {"json": FLAG_SCHEMA, "disable_any_whitespace": True},
                **structured,
            },
            check=json_answer(FLAG_SCHEMA, must_finish=True),
        ),
        Case(
            "structured_choice", {"structured_outputs": {"choice": CHOICES}}, check=one_of(CHOICES)
        ),
        Case("structured_regex", {"structured_outputs": {"regex": REGEX}}, check=matches(REGEX)),
        Case(
            "structured_grammar",
            {"structured_outputs": {"grammar": GRAMMAR}},
            check=one_of(CHOICES),
        ),
        # tools
        Case(
            "tool_choice_named",
            {
                "tools": [WEATHER_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                **structured,
            },
            check=forced_tool_call(WEATHER_TOOL, only_one=True),
        ),
        Case(
            "tool_choice_required",
            # A list of calls, each naming its function: more than CONSTRAINED_TOKENS of the
            # tiny Llama's tokens, cut short of a whole call at 32 (no tool call at all).
            {"tools": [WEATHER_TOOL], "tool_choice": "required", "max_tokens": REQUIRED_TOKENS},
            check=forced_tool_call(WEATHER_TOOL, only_one=False),
        ),
    ]


MATRIX_FIELDS = frozenset(
    {
        "echo", "seed", "top_k", "top_p", "min_p", "top_logprobs", "stop",
        "include_stop_str_in_output", "min_tokens", "stop_token_ids", "ignore_eos", "logit_bias",
        "bad_words", "frequency_penalty", "presence_penalty", "repetition_penalty",
        "skip_special_tokens", "chat_template_kwargs", "add_generation_prompt",
        "continue_final_message", "response_format", "structured_outputs", "tools", "tool_choice",
    }
)  # fmt: skip
"""The fields the matrix exercises (beyond the base body's)."""


# ---------------------------------------------------------------- constrained answers


def json_answer(
    schema: dict[str, Any], *, must_finish: bool
) -> Callable[[Reply, Validator], list[str]]:
    """The answer's text is JSON valid against ``schema`` (when it finished, or always)."""

    def check(reply: Reply, validate: Validator) -> list[str]:
        view = answer_view(reply)
        if view["finish_reason"] != "stop":
            return [f"the JSON answer did not finish: {view}"] if must_finish else []
        try:
            value = json.loads(view["text"] or "")
        except ValueError as exc:
            return [f"the answer is not JSON ({exc}): {view['text']!r}"]
        return validate(value, schema)

    return check


def one_of(choices: list[str]) -> Callable[[Reply, Validator], list[str]]:
    """The answer's text is one of ``choices``."""

    def check(reply: Reply, validate: Validator) -> list[str]:
        text = answer_view(reply)["text"]
        return [] if text in choices else [f"{text!r} is not one of {choices}"]

    return check


def matches(pattern: str) -> Callable[[Reply, Validator], list[str]]:
    """The answer's text matches ``pattern`` in full."""

    def check(reply: Reply, validate: Validator) -> list[str]:
        text = answer_view(reply)["text"] or ""
        return [] if re.fullmatch(pattern, text) else [f"{text!r} does not match {pattern}"]

    return check


def forced_tool_call(
    tool: dict[str, Any], *, only_one: bool
) -> Callable[[Reply, Validator], list[str]]:
    """The answer, read with the official ``openai`` client's types, calls ``tool`` (once when
    ``only_one``: a named tool_choice; at least once for ``required``, where the model may list
    several calls), each call's arguments valid against the tool's parameters (when the answer
    finished)."""
    name = tool["function"]["name"]
    parameters = tool["function"]["parameters"]

    def check(reply: Reply, validate: Validator) -> list[str]:
        try:
            completion = ChatCompletion.model_validate(reply.body)
        except ValidationError as exc:
            return [f"the openai client cannot read the answer: {exc}"]
        choice = completion.choices[0]
        calls = choice.message.tool_calls or []
        if not calls or (only_one and len(calls) != 1):
            wanted = "one tool call" if only_one else "a tool call"
            return [f"expected {wanted}, got {len(calls)}: {choice.message}"]
        problems: list[str] = []
        for call in calls:
            function = getattr(call, "function", None)
            if function is None or function.name != name:
                problems.append(f"expected a call of {name}, got {call}")
            elif choice.finish_reason != "length":  # cut short: arguments may be incomplete
                try:
                    arguments = json.loads(function.arguments)
                except ValueError as exc:
                    problems.append(
                        f"the tool call's arguments are not JSON ({exc}): {function.arguments!r}"
                    )
                else:
                    problems.extend(validate(arguments, parameters))
        return problems

    return check


CHECK_JSON = Path(__file__).with_name("check_json.py")
MISSING_JSONSCHEMA = 3
"""``check_json.py``'s exit status when its Python has no ``jsonschema``."""


def jsonschema_validator(python: Path | str) -> Validator:
    """A :data:`Validator` that runs ``jsonschema`` in ``python`` (the lane's virtualenv has it).

    Raises (when called):
        RuntimeError: ``python`` has no ``jsonschema``, or the check crashed.
    """

    def validate(instance: object, schema: object) -> list[str]:
        payload = json.dumps({"instance": instance, "schema": schema})
        done = subprocess.run(
            [str(python), str(CHECK_JSON)],
            input=payload,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode == MISSING_JSONSCHEMA:
            raise RuntimeError(f"{python} has no jsonschema: {done.stderr.strip()}")
        if done.returncode != 0:
            raise RuntimeError(f"check_json.py failed ({done.returncode}): {done.stderr.strip()}")
        errors: list[str] = json.loads(done.stdout)
        return errors

    return validate


# ---------------------------------------------------------------- running it


@dataclass
class CaseResult:
    """How one case went: ``equal``, ``refused <param>`` or ``failed``, and why."""

    name: str
    outcome: str
    problems: list[str] = field(default_factory=list)


@dataclass
class MatrixReport:
    """Every case's result, by name, in matrix order."""

    profile: str
    results: dict[str, CaseResult] = field(default_factory=dict)

    def problems(self) -> list[str]:
        return [
            f"{self.profile}: {name}: {problem}"
            for name, result in self.results.items()
            for problem in result.problems
        ]

    def outcomes(self) -> dict[str, str]:
        return {name: result.outcome for name, result in self.results.items()}


class PlainAnswers:
    """The plain engine's answers, asked once per body (the lane asks for two backends)."""

    def __init__(self, client: httpx.Client, url: str) -> None:
        self.client = client
        self.url = url
        self._answers: dict[tuple[str, str], Reply] = {}

    def get(self, path: str, body: dict[str, Any]) -> Reply:
        key = (path, json.dumps(body, sort_keys=True))
        if key not in self._answers:
            self._answers[key] = post(self.client, self.url, path, body)
        return self._answers[key]

    def facts(self, model: Model) -> Facts:
        return facts_of(self.get(CHAT, probe_body(model)))


def refusal_problems(reply: Reply, param: str) -> list[str]:
    """Why ``reply`` is not a 400 naming ``param`` (empty when it is)."""
    if reply.status == 400 and reply.error_param == param:
        return []
    return [f"expected 400 naming {param!r}, got {reply.status} {json.dumps(reply.body)[:400]}"]


def effect_problems(
    case: Case, fields: Iterable[str], plain: Reply, reference: Reply | None, profile: Profile
) -> list[str]:
    """Why the plain answer does not show that the case's fields did something."""
    if case.reference is None or profile.inert.intersection(fields):
        return []
    if reference is None or reference.status != 200:
        body = None if reference is None else reference.body
        return [f"its reference {case.reference!r} has no answer: {body}"]
    if differences(answer_view(reference), answer_view(plain)):
        return []
    return [
        f"{sorted(case.fields)} changed nothing on the plain engine (same answer as "
        f"{case.reference!r}), so comparing cannot show that the router forwards them"
    ]


def check_case(
    case: Case,
    body: dict[str, Any],
    *,
    router: Reply,
    plain: Reply | None,
    reference: Reply | None,
    profile: Profile,
    validate: Validator,
) -> CaseResult:
    """Judge one case from its replies (``plain`` None: the case was expected refused)."""
    refused = profile.expected_refusal(body)
    if refused is not None:
        return CaseResult(case.name, f"refused {refused}", refusal_problems(router, refused))
    problems = [
        f"the {who} answered {reply.status}: {json.dumps(reply.body)[:400]}"
        for who, reply in (("plain engine", plain), ("router", router))
        if reply is None or reply.status != 200
    ]
    if problems or plain is None:
        return CaseResult(case.name, "failed", problems)
    problems += [
        f"the router differs from the plain engine at {difference}"
        for difference in differences(answer_view(plain), answer_view(router))
    ]
    problems += effect_problems(case, body, plain, reference, profile)
    if case.check is not None:
        for who, reply in (("plain engine", plain), ("router", router)):
            problems += [f"the {who}'s answer: {p}" for p in case.check(reply, validate)]
    return CaseResult(case.name, "failed" if problems else "equal", problems)


def run_matrix(
    client: httpx.Client,
    *,
    router_url: str,
    plain: PlainAnswers,
    model: Model,
    profile: Profile,
    validate: Validator,
    cases: Callable[[Model, Facts], list[Case]] = build_cases,
) -> MatrixReport:
    """Send every case to the router (and, unless it must be refused, to the plain engine).

    Sequential: one request in flight, so the engines' batching cannot make
    answers differ.  Transport errors propagate (an endpoint that is down is
    not a matrix result).
    """
    built = cases(model, plain.facts(model))
    by_name = {case.name: case for case in built}
    report = MatrixReport(profile.name)
    for case in built:
        body = case.body(model)
        router = post(client, router_url, case.path, body)
        plain_reply = reference = None
        if profile.expected_refusal(body) is None:
            plain_reply = plain.get(case.path, body)
            if case.reference is not None:
                ref = by_name[case.reference]
                reference = plain.get(ref.path, ref.body(model))
        report.results[case.name] = check_case(
            case,
            body,
            router=router,
            plain=plain_reply,
            reference=reference,
            profile=profile,
            validate=validate,
        )
    return report


# ---------------------------------------------------------------- the profiles

VLLM_HTTP = Profile("vllm serve via openai_http")
"""``vllm serve`` behind the router: every field reaches it in the body, as on a plain one."""

VLLM_NATIVE = Profile(
    "worker --engine vllm via native",
    refuses=frozenset({"echo", "tools", "tool_choice"}),
)
"""The native vLLM engine: honours the sampling, structured-output and template fields
(``VLLM_OPTIONS``), refuses the rest by name."""

SIM_REFUSES = frozenset(
    {
        "echo", "min_p", "logit_bias", "bad_words", "frequency_penalty", "presence_penalty",
        "repetition_penalty", "chat_template_kwargs", "add_generation_prompt",
        "continue_final_message", "response_format", "structured_outputs", "tools", "tool_choice",
    }
)  # fmt: skip
SIM = Profile(
    "sim --serve-openai via openai_http",
    refuses=SIM_REFUSES,
    inert=frozenset({"top_k", "top_p", "top_logprobs", "ignore_eos", "skip_special_tokens"}),
)
"""The simulator (``SIM_OPTIONS``): its text depends on the prompt, temperature, seed, stop
strings and tokens and ``min_tokens`` only; it has no alternatives to list, no EOS and no
special tokens."""

PROFILES = {"openai_http": VLLM_HTTP, "native": VLLM_NATIVE}
"""The lane's profile of each backend."""
