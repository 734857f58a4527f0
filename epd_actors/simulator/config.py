"""The simulator's knobs: :class:`SimConfig`, how each field is documented, parsed and checked.

Each field carries a :class:`KnobSpec` in its metadata; :func:`sim_knobs` lists
them in declaration order for the command line (:mod:`.cli`) and the docs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, TypeVar

from ..errors import ConfigError

_T = TypeVar("_T")

Check = Callable[[object], "str | None"]


@dataclass(frozen=True, slots=True)
class KnobSpec:
    """How one :class:`SimConfig` field is documented, parsed from text and checked.

    ``parse`` is None for a boolean flag.  ``check`` returns a problem or None.
    """

    doc: str
    parse: Callable[[str], object] | None
    check: Check
    metavar: str = ""


def _knob(default: _T, spec: KnobSpec) -> _T:
    value: _T = field(default=default, metadata={"knob": spec})
    return value


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _seconds(*, inf_ok: bool = False, positive: bool = False) -> Check:
    def check(value: object) -> str | None:
        number = _number(value)
        if number is None or math.isnan(number):
            return f"must be a number of seconds (got {value!r})"
        if number < 0 or (positive and number == 0):
            return f"must be {'>' if positive else '>='} 0 (got {value!r})"
        if math.isinf(number) and not inf_ok:
            return "must be finite"
        return None

    return check


def _rate(value: object) -> str | None:
    number = _number(value)
    if number is None or not 0.0 <= number <= 1.0:
        return f"must be a probability in [0, 1] (got {value!r})"
    return None


def _count(minimum: int, *, optional: bool = False) -> Check:
    def check(value: object) -> str | None:
        if value is None and optional:
            return None
        if type(value) is not int or value < minimum:
            return f"must be an integer >= {minimum} (got {value!r})"
        return None

    return check


def _parse_optional_int(text: str) -> int | None:
    return None if text.lower() in {"off", "none"} else int(text)


def _one_of(*choices: str) -> Check:
    def check(value: object) -> str | None:
        return None if value in choices else f"must be one of {', '.join(choices)}"

    return check


def _boolean(value: object) -> str | None:
    return None if isinstance(value, bool) else f"must be true or false (got {value!r})"


def _secs(doc: str, **kw: bool) -> KnobSpec:
    return KnobSpec(doc, float, _seconds(**kw), "SECONDS")


def _ints(doc: str, minimum: int) -> KnobSpec:
    return KnobSpec(doc, int, _count(minimum), "N")


def _ints_or_off(doc: str, minimum: int) -> KnobSpec:
    return KnobSpec(doc, _parse_optional_int, _count(minimum, optional=True), "N|off")


def _probability(doc: str) -> KnobSpec:
    return KnobSpec(doc, float, _rate, "P")


def _any_int(value: object) -> str | None:
    return None if type(value) is int else f"must be an integer (got {value!r})"


def _text(value: object) -> str | None:
    return None if isinstance(value, str) else f"must be text (got {value!r})"


def _optional_text(value: object) -> str | None:
    return None if value is None or isinstance(value, str) else f"must be text (got {value!r})"


def _parse_optional_text(text: str) -> str | None:
    return None if text.lower() in {"off", "none"} else text


def _address(doc: str) -> KnobSpec:
    return KnobSpec(doc + " (off = none)", _parse_optional_text, _optional_text, "ADDRESS|off")


_EC_MODES: Final = ("strict", "recompute")


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Every simulator knob, with defaults that keep tests and demos fast but nonzero.

    Each field's ``metadata["knob"]`` is a :class:`KnobSpec` whose ``doc`` gives
    the meaning and unit; the CLI (``--sim-<field-name>``) and docs/simulator.md
    follow the same list.  Invalid values raise ``ConfigError`` naming the field.
    """

    encode_item_s: float = _knob(0.005, _secs("encoder time per media item, seconds"))
    encode_kib_s: float = _knob(0.00001, _secs("extra encoder time per KiB of media, seconds"))
    prefill_token_s: float = _knob(0.00005, _secs("prefill time per prompt token, seconds"))
    first_token_s: float = _knob(
        0.002, _secs("from end of prefill (PD) or KV load (D) to token 1, seconds")
    )
    output_token_s: float = _knob(
        0.001, _secs("time per output token after the first, seconds; 0 = unpaced")
    )
    tokens_per_delta: int = _knob(16, _ints("tokens per delta when output_token_s is 0", 1))
    step_clock: bool = _knob(
        False,
        KnobSpec(
            "paced tokens of every stream come out together, on one clock ticking every "
            "output_token_s (an engine's decode steps), not on each stream's own timer",
            None,
            _boolean,
        ),
    )
    media_tokens_per_item: int = _knob(256, _ints("prompt tokens each media item adds", 0))
    max_model_len: int = _knob(
        8192,
        _ints(
            "context window, tokens: a request without max_tokens generates up to its end "
            "(as vLLM does); a longer prompt, or a max_tokens past it, is refused",
            1,
        ),
    )
    ec_mode: str = _knob(
        "strict",
        KnobSpec(
            "missing encoder-cache entry on P/PD: strict = refuse, recompute = encode it there",
            str,
            _one_of(*_EC_MODES),
            "{" + ",".join(_EC_MODES) + "}",
        ),
    )
    kv_ttl_s: float = _knob(
        30.0, _secs("KV handle lifetime; unconsumed = leaked, seconds", inf_ok=True, positive=True)
    )
    verify_media_hash: bool = _knob(
        False, KnobSpec("refuse media whose content_hash is not sha256(data)", None, _boolean)
    )
    encode_error_rate: float = _knob(0.0, _probability("chance an encode fails (retryable)"))
    prefill_error_rate: float = _knob(0.0, _probability("chance a prefill fails (retryable)"))
    generate_error_rate: float = _knob(
        0.0, _probability("chance a generate fails before its first token (retryable)")
    )
    stall_s: float = _knob(
        0.0, _secs("sleep before every stage request, seconds; inf = hang", inf_ok=True)
    )
    stall_after_tokens: int | None = _knob(
        None, _ints_or_off("hang a stream forever after N tokens", 0)
    )
    crash_after_tokens: int | None = _knob(
        None, _ints_or_off("crash the engine after N tokens of a stream", 0)
    )
    crash_on_request: int | None = _knob(
        None, _ints_or_off("crash the engine when its Nth stage request arrives", 1)
    )
    prefix_cache_blocks: int = _knob(
        0,
        _ints(
            "KV blocks of each P/PD engine's prefix cache (LRU); prefill time is spent on "
            "the uncached tokens only; 0 = no prefix cache",
            0,
        ),
    )
    prefix_block_size: int = _knob(16, _ints("tokens per prefix-cache block", 1))
    prefix_hash_seed: int | None = _knob(
        None, _ints_or_off("seed of the engine's block hashes; off = random per engine", 0)
    )
    kv_events_endpoint: str | None = _knob(
        None,
        _address(
            "publish KV cache events (vLLM's wire format, ZMQ PUB) on this address, "
            "e.g. tcp://127.0.0.1:5557; needs prefix_cache_blocks"
        ),
    )
    kv_events_replay_endpoint: str | None = _knob(
        None, _address("serve KV event replay (ZMQ ROUTER) on this address")
    )
    kv_events_encoding: str = _knob(
        "map",
        KnobSpec(
            "KV event encoding: map = vLLM after PR #42892, array = vLLM before it",
            str,
            _one_of("map", "array"),
            "{map,array}",
        ),
    )
    kv_events_topic: str = _knob(
        "", KnobSpec("topic frame of every KV event message", str, _text, "TOPIC")
    )
    fault_seed: int = _knob(
        0, KnobSpec("seed of the fault RNG (mixed with the worker id)", int, _any_int, "N")
    )

    def __post_init__(self) -> None:
        for knob in sim_knobs():
            problem = knob.spec.check(getattr(self, knob.name))
            if problem is not None:
                raise ConfigError(f"simulator {knob.name}: {problem}")


@dataclass(frozen=True, slots=True)
class Knob:
    """One :class:`SimConfig` field: its name, default and :class:`KnobSpec`."""

    name: str
    default: object
    spec: KnobSpec


@functools.cache
def sim_knobs() -> tuple[Knob, ...]:
    """Every :class:`SimConfig` knob in declaration order (for the CLI and docs)."""
    return tuple(Knob(f.name, f.default, f.metadata["knob"]) for f in dataclasses.fields(SimConfig))
