"""Which models a router serves, and which LoRA adapters belong to which model.

Theory of operation: every pool serves one model (``WorkerPool.model``).  A
request's ``model`` resolves (:meth:`ModelCatalog.resolve`) to a
:class:`ModelRoute`: the model whose pools it runs on, and the LoRA adapter
its stage requests carry.  A name is, in this order: a model some pool
serves; a configured adapter (``RouterConfig.models``); an adapter a worker
of some pool announced or listed (``BackendStatus.adapters``), which belongs
to that pool's model.  Anything else is ``ModelNotFound``.  A request without
a model is for the default model.

The catalog reads the pools at the moment it is asked (no copy to keep in
sync): an adapter a vLLM worker loaded, or a worker that connected, counts
from the next request on.  Pure and synchronous.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ModelNotFound

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from .pool import WorkerPool


@dataclass(frozen=True, slots=True)
class ModelCard:
    """One entry of ``GET /v1/models``.

    Attributes:
        id: the name a request gives as ``model``.
        parent: for a LoRA adapter, its base model (as vLLM lists adapters); else None.
    """

    id: str
    parent: str | None = None


@dataclass(frozen=True, slots=True)
class ModelRoute:
    """Where a request's ``model`` leads.

    Attributes:
        model: the model whose pools serve the request (None: the pools of a
            router whose pools name no model).
        adapter: the LoRA adapter to apply, or None for the base model.
    """

    model: str | None
    adapter: str | None = None


class ModelCatalog:
    """The models and adapters behind one router's pools.

    Args:
        pools: every pool of the router (each serves ``pool.model``).
        default_model: the model of a request that names none.
        adapters: configured adapter name -> its base model.
    """

    def __init__(
        self,
        pools: Iterable[WorkerPool],
        *,
        default_model: str | None = None,
        adapters: Mapping[str, str] | None = None,
    ) -> None:
        self._pools = tuple(pools)
        self.default_model = default_model
        self._adapters = dict(adapters or {})
        self._models = tuple(dict.fromkeys(pool.model for pool in self._pools))

    def __repr__(self) -> str:
        return f"<ModelCatalog models={list(self._models)} adapters={sorted(self._adapters)}>"

    @property
    def models(self) -> tuple[str | None, ...]:
        """The models the pools serve, in pool order."""
        return self._models

    def resolve(self, name: str | None) -> ModelRoute:
        """The route of a request naming ``name`` (None: the default model).

        Raises:
            ModelNotFound: no pool serves ``name``, and it is no adapter of a
                model some pool serves.
        """
        if name is None or name == self.default_model:
            return ModelRoute(self.default_model)
        if name in self._models:
            return ModelRoute(name)
        base = self._adapters.get(name)
        if base is not None:
            return ModelRoute(base, name)
        for pool in self._pools:
            if any(name in member.backend.status().adapters for member in pool.members):
                return ModelRoute(pool.model, name)
        raise ModelNotFound(name)

    def cards(self) -> list[ModelCard]:
        """Every model, then every adapter (configured first, then learned from workers)."""
        cards = [ModelCard(model) for model in self._models if model is not None]
        adapters = dict(self._adapters)
        for pool in self._pools:
            if pool.model is None:
                continue
            for member in pool.members:
                for adapter in sorted(member.backend.status().adapters):
                    adapters.setdefault(adapter, pool.model)
        cards += [ModelCard(name, parent) for name, parent in adapters.items()]
        return cards

    def serves(self, name: str) -> bool:
        """Whether a request may name ``name``: the ``id`` of one of :meth:`cards`.

        Per request, so it builds no cards: a served model or a configured
        adapter is found without asking any worker; only another name looks
        through the adapters the workers announced.
        """
        if name in self._models or name in self._adapters:
            return True
        return any(
            name in member.backend.status().adapters
            for pool in self._pools
            if pool.model is not None
            for member in pool.members
        )

    def names(self) -> list[str]:
        """The ``id`` of every card."""
        return [card.id for card in self.cards()]


def model_list_body(models: Sequence[str | ModelCard]) -> dict[str, object]:
    """OpenAI's ``GET /v1/models`` answer; an adapter's card names its ``parent``, as vLLM's."""
    data: list[dict[str, object]] = []
    for model in models:
        card = ModelCard(model) if isinstance(model, str) else model
        entry: dict[str, object] = {
            "id": card.id,
            "object": "model",
            "created": 0,
            "owned_by": "epd_actors",
        }
        if card.parent is not None:
            entry["parent"] = card.parent
        data.append(entry)
    return {"object": "list", "data": data}
