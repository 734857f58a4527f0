"""Prompt tokenizers for routing on the engines' own blocks: a registry by name.

Theory of operation
-------------------
The ``kv_aware`` policy matches a prompt against the blocks each engine
reported in its KV events, and those blocks are token ids, so the router must
turn a request into the token ids the engine will prefill.  How is a property
of the engines a pool runs, so it is configured per pool (the policy's
``tokenizer`` option) and looked up here by name:

- ``sim``: the simulator's deterministic tokenization
  (:func:`epd_actors.simulator.prefix_cache.prompt_token_ids`: one id per
  whitespace word, ``media_tokens_per_item`` ids per media item), exactly what
  simulated workers prefill and publish;
- ``hf``: a Hugging Face ``tokenizers`` tokenizer read from a
  ``tokenizer.json`` (the ``tokenizer_path`` option), for text and token-id
  prompts; a chat has no tokens without the model's chat template, so it gets
  none and the policy falls back to its approximate choice.  The library is
  the optional ``hf-tokenizer`` extra, imported when such a tokenizer is built.

Token-id prompts are passed through by both.  A new tokenizer is one class
with ``name``, ``options``, ``build(options)`` and ``token_ids(request)``, and
:func:`register_tokenizer`.  Pure and synchronous: tokenizing is CPU work on
the routing path, bounded by the prompt's size.
"""

from __future__ import annotations

import typing
from typing import TYPE_CHECKING, Any, ClassVar, Final, Protocol, TypeVar

from ...errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ...request import GenerationRequest
    from .base import PromptTokenizer

__all__ = [
    "HfTokenizer",
    "SimTokenizer",
    "TokenizerClass",
    "build_tokenizer",
    "register_tokenizer",
    "tokenizer_names",
]


class TokenizerClass(Protocol):
    """What :func:`register_tokenizer` needs of a tokenizer class."""

    name: str
    options: frozenset[str]

    def build(self, options: Mapping[str, object]) -> PromptTokenizer:
        """A new tokenizer from its options (already known to be in ``options``)."""
        ...


_REGISTRY: Final[dict[str, TokenizerClass]] = {}

T = TypeVar("T")


def register_tokenizer(cls: T) -> T:
    """Class decorator: make a tokenizer class configurable by its ``name``.

    Raises:
        ValueError: another class holds the name already.
    """
    tokenizer = typing.cast("TokenizerClass", cls)
    if tokenizer.name in _REGISTRY and _REGISTRY[tokenizer.name] is not tokenizer:
        raise ValueError(f"tokenizer {tokenizer.name!r} is registered already")
    _REGISTRY[tokenizer.name] = tokenizer
    return cls


def tokenizer_names() -> tuple[str, ...]:
    """Every registered tokenizer name."""
    return tuple(_REGISTRY)


def build_tokenizer(name: str, options: Mapping[str, object]) -> PromptTokenizer:
    """Build the tokenizer ``name`` from ``options`` (only its own options).

    Raises:
        ConfigError: unknown name, an option it does not take, a bad value,
            or its library missing.
    """
    cls = _REGISTRY.get(name)
    if cls is None:
        known = ", ".join(tokenizer_names())
        raise ConfigError(f"unknown tokenizer {name!r}; choose one of: {known}")
    unknown = sorted(set(options) - cls.options)
    if unknown:
        raise ConfigError(f"tokenizer {name!r} takes no option {', '.join(unknown)}")
    return cls.build(options)


@register_tokenizer
class SimTokenizer:
    """The simulator's token ids (see the module docstring).

    Args:
        media_tokens_per_item: the simulated workers' ``media_tokens_per_item``.
    """

    name: ClassVar[str] = "sim"
    options: ClassVar[frozenset[str]] = frozenset({"media_tokens_per_item"})

    def __init__(self, media_tokens_per_item: int = 256) -> None:
        from ...simulator.prefix_cache import prompt_token_ids

        self.media_tokens_per_item = media_tokens_per_item
        self._ids = prompt_token_ids

    @classmethod
    def build(cls, options: Mapping[str, object]) -> PromptTokenizer:
        value = options.get("media_tokens_per_item", 256)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(
                f"routing option media_tokens_per_item must be an integer >= 0, got {value!r}"
            )
        return cls(value)

    def token_ids(self, request: GenerationRequest) -> tuple[int, ...] | None:
        ids = self._ids(request.prompt, request.media, self.media_tokens_per_item)
        return tuple(ids)


@register_tokenizer
class HfTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer (see the module docstring).

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        add_special_tokens: whether the engines add them (vLLM does for completions).
    """

    name: ClassVar[str] = "hf"
    options: ClassVar[frozenset[str]] = frozenset({"tokenizer_path", "add_special_tokens"})

    def __init__(self, tokenizer: Any, *, add_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self.add_special_tokens = add_special_tokens

    @classmethod
    def build(cls, options: Mapping[str, object]) -> PromptTokenizer:
        path = options.get("tokenizer_path")
        if not isinstance(path, str) or not path:
            raise ConfigError("routing option tokenizer_path (a tokenizer.json) is required for hf")
        special = options.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise ConfigError(
                f"routing option add_special_tokens must be a boolean, got {special!r}"
            )
        try:
            import tokenizers
        except ImportError:
            raise ConfigError(
                "the hf tokenizer needs the tokenizers library: "
                "pip install 'epd_actors[hf-tokenizer]'"
            ) from None
        try:
            loaded = tokenizers.Tokenizer.from_file(path)
        except Exception as exc:  # the library raises its own exception types
            raise ConfigError(
                f"routing option tokenizer_path: cannot load {path!r}: {exc}"
            ) from None
        return cls(loaded, add_special_tokens=special)

    def token_ids(self, request: GenerationRequest) -> tuple[int, ...] | None:
        prompt = request.prompt
        if prompt.token_ids is not None:
            return tuple(prompt.token_ids)
        if prompt.text is None:
            return None  # a chat: the template is the engine's
        encoded = self._tokenizer.encode(prompt.text, add_special_tokens=self.add_special_tokens)
        return tuple(encoded.ids)
