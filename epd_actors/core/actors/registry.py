"""Stage name -> actor class.  A new stage is one class plus ``@register_stage``.

The supervisor builds one actor per configured pool by looking its stage up
here, and plans requests from the actors' class attributes; it never branches
on a stage's name.
"""

from __future__ import annotations

from typing import TypeVar

from ...errors import ConfigError
from .base import BaseActor

STAGE_ACTORS: dict[str, type[BaseActor]] = {}

A = TypeVar("A", bound=type[BaseActor])


def register_stage(cls: A, registry: dict[str, type[BaseActor]] | None = None) -> A:
    """Register an actor class under its ``stage`` name (usable as a decorator)."""
    target = STAGE_ACTORS if registry is None else registry
    existing = target.get(cls.stage)
    if existing is not None and existing is not cls:
        raise ConfigError(f"stage {cls.stage!r} is already served by {existing.__name__}")
    target[cls.stage] = cls
    return cls


def actor_class(stage: str, registry: dict[str, type[BaseActor]] | None = None) -> type[BaseActor]:
    """The actor class of ``stage``.

    Raises:
        ConfigError: no class serves that stage.
    """
    target = STAGE_ACTORS if registry is None else registry
    try:
        return target[stage]
    except KeyError:
        known = ", ".join(sorted(target))
        raise ConfigError(f"unknown stage {stage!r} (known: {known})") from None


def stage_policy(
    stage: str, configured: str | None, registry: dict[str, type[BaseActor]] | None = None
) -> str:
    """A pool's routing policy: ``configured``, else its stage actor's ``default_policy``.

    A stage no actor class serves gets :attr:`BaseActor.default_policy`.
    """
    if configured:
        return configured
    target = STAGE_ACTORS if registry is None else registry
    return target.get(stage, BaseActor).default_policy
