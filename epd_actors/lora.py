"""LoRA adapters: how workers announce them and how a backend loads one at run time.

Theory of operation: a request whose ``model`` names a LoRA adapter runs on
the pools of the adapter's base model, and its stage requests carry the
adapter's name (``lora_adapter`` on the native protocol; the body's ``model``
for a vLLM server, which routes adapters by that name).  A worker says which
adapters it has loaded -- a native worker with ``lora:NAME`` entries in its
``Welcome`` capabilities, a vLLM server with model cards whose ``parent`` is
its base model in ``GET /v1/models`` -- and the pool prefers those workers.

When none of them has it and the pool allows run-time loading, the chosen
vLLM worker is sent ``POST /v1/load_lora_adapter`` first.  :class:`AdapterLoads`
makes that happen once per worker and adapter: concurrent requests for the
same adapter wait for the one load in flight, and a failed load is tried
again by the next request.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from .errors import AdapterLoadFailed, ConfigError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterable, Mapping

LOAD_LORA_PATH = "/v1/load_lora_adapter"
"""vLLM's run-time LoRA loading endpoint (with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``)."""

LORA_CAPABILITY_PREFIX = "lora:"
"""A ``Welcome`` capability ``lora:NAME`` says the worker serves the adapter ``NAME``."""


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """A LoRA adapter of a model.

    Attributes:
        name: what a request names in ``model`` (vLLM's ``lora_name``).
        path: where a vLLM worker loads it from (``lora_path``); None: the
            router never loads it, workers must have it already.
    """

    name: str
    path: str | None = None


def lora_capabilities(names: Iterable[str]) -> tuple[str, ...]:
    """The ``Welcome`` capabilities announcing ``names``.

    Raises:
        ConfigError: an empty name.
    """
    names = tuple(names)
    if any(not name for name in names):
        raise ConfigError("a LoRA adapter name must not be empty")
    return tuple(LORA_CAPABILITY_PREFIX + name for name in names)


@functools.lru_cache(maxsize=256)
def announced_adapters(capabilities: tuple[str, ...]) -> frozenset[str]:
    """The adapters a worker's ``Welcome`` capabilities announce (cached: read per lease)."""
    prefix = LORA_CAPABILITY_PREFIX
    return frozenset(c[len(prefix) :] for c in capabilities if c.startswith(prefix) and c != prefix)


def listed_adapters(reply: Mapping[str, object], base_model: str) -> frozenset[str]:
    """The adapters of ``base_model`` a ``GET /v1/models`` answer lists.

    vLLM lists each loaded adapter as a card whose ``parent`` is the base
    model's id; anything unreadable is ignored (the model check judges the
    list itself).
    """
    cards = reply.get("data")
    if not isinstance(cards, list):
        return frozenset()
    found = set()
    for card in cards:
        if not isinstance(card, dict):
            continue
        ident, parent = card.get("id"), card.get("parent")
        if isinstance(ident, str) and parent == base_model and ident != base_model:
            found.add(ident)
    return frozenset(found)


class _Load:
    """One load in flight: waiters wait for ``done`` and then read ``failure``."""

    __slots__ = ("done", "failure")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.failure: AdapterLoadFailed | None = None


class AdapterLoads:
    """The adapters one worker has, and the loads under way (one per adapter).

    ``loaded`` is what the worker announced plus what was loaded through
    :meth:`ensure` since the worker was last seen to go away.
    """

    __slots__ = ("_pending", "announced", "loaded_here", "loads")

    def __init__(self) -> None:
        self.announced: frozenset[str] = frozenset()
        self.loaded_here: set[str] = set()
        self.loads = 0  # loads started (observability, tests)
        self._pending: dict[str, _Load] = {}

    @property
    def loaded(self) -> frozenset[str]:
        return self.announced | self.loaded_here

    def forget(self) -> None:
        """The worker went away: what was loaded there is gone with it."""
        self.loaded_here.clear()

    async def ensure(self, name: str, load: Callable[[], Awaitable[None]]) -> None:
        """Return once ``name`` is loaded, calling ``load`` unless it is, or a load runs.

        Raises:
            AdapterLoadFailed: ``load`` failed (raised, as a fresh error, to
                every request that waited for that load).

        Cancellation: a waiter may leave at any time.  The load runs in the
        task of the request that started it; if that request is cancelled
        the load ends, and a waiter starts the next one.
        Backpressure: concurrent requests for one adapter wait for one load.
        """
        while name not in self.loaded:
            pending = self._pending.get(name)
            if pending is None:
                await self._load(name, load)
                return
            await pending.done.wait()
            if pending.failure is not None:
                failure = pending.failure
                raise AdapterLoadFailed(
                    failure.detail, adapter=failure.adapter, worker_id=failure.worker_id
                )
        await trio.lowlevel.checkpoint()

    async def _load(self, name: str, load: Callable[[], Awaitable[None]]) -> None:
        pending = self._pending[name] = _Load()
        self.loads += 1
        try:
            await load()
            self.loaded_here.add(name)
        except AdapterLoadFailed as exc:
            pending.failure = exc
            raise
        finally:
            del self._pending[name]
            pending.done.set()
