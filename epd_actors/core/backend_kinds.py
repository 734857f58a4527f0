"""Backend kinds by name: how a worker's address is checked, and how its backends are built.

A worker's ``backend`` (``native``, ``openai_http``, or a kind registered by a
program that embeds the router) names a :class:`BackendKind`.  The
configuration checks each worker's address with the kind's
:meth:`~BackendKind.check_address`; the router asks the kind, once per router,
for a factory (:meth:`~BackendKind.open_factory`) and builds every backend of
that kind with it, so backends of one kind may share what the kind needs (the
``openai_http`` backends share one KV hand-off ledger).  A new kind is one
class plus :func:`register_backend_kind`; nothing else chooses by a kind's name.

The built-in kinds import their backend modules only when a factory is opened:
a router of native workers never imports the HTTP client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar

from ..addresses import check_http_url, parse_address
from ..errors import ConfigError
from .config import register_address_check

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..backends.base import ManagedBackend
    from .config import RouterConfig, WorkerEndpoint


class BackendKind(Protocol):
    """What :func:`register_backend_kind` needs of a kind."""

    name: ClassVar[str]

    def check_address(self, address: str, *, key: str) -> None:
        """Refuse an address this kind cannot reach (``ConfigError`` naming ``key``)."""
        ...

    def open_factory(
        self, config: RouterConfig, settings: object | None
    ) -> Callable[[WorkerEndpoint, RouterConfig], ManagedBackend]:
        """A factory for this router's backends of this kind.

        Args:
            config: the router's configuration.
            settings: the kind's settings when the caller overrides the
                configuration's (``DefaultBackendFactory(openai_http=...)``), else None.
        """
        ...


_KINDS: dict[str, BackendKind] = {}

K = TypeVar("K", bound=type)


def register_backend_kind(cls: K) -> K:
    """Class decorator: make the kind ``cls`` (built without arguments) usable by its name.

    Raises:
        ValueError: another kind holds the name already.
    """
    kind: BackendKind = cls()
    existing = _KINDS.get(kind.name)
    if existing is not None and type(existing) is not cls:
        raise ValueError(f"backend kind {kind.name!r} is registered already")
    _KINDS[kind.name] = kind
    register_address_check(kind.name, lambda address, key: kind.check_address(address, key=key))
    return cls


def backend_kind_names() -> tuple[str, ...]:
    """Every registered kind's name, in registration order."""
    return tuple(_KINDS)


def backend_kind(name: str, *, key: str = "backend") -> BackendKind:
    """The kind called ``name``.

    Raises:
        ConfigError: naming ``key`` and the registered kinds.
    """
    kind = _KINDS.get(name)
    if kind is None:
        raise ConfigError(
            f"{key}: unknown backend {name!r} (choose from {', '.join(backend_kind_names())})"
        )
    return kind


@register_backend_kind
class NativeKind:
    """``native``: an ``epd_actors worker`` at ``tcp://HOST:PORT`` or ``unix:PATH``."""

    name: ClassVar[str] = "native"

    def check_address(self, address: str, *, key: str) -> None:
        parse_address(address, key=key)

    def open_factory(
        self, config: RouterConfig, settings: object | None
    ) -> Callable[[WorkerEndpoint, RouterConfig], ManagedBackend]:
        from ..backends.native.backend import NativeBackend
        from ..backends.native.settings import NativeSettings

        chosen = settings if isinstance(settings, NativeSettings) else config.native

        def build(endpoint: WorkerEndpoint, config: RouterConfig) -> ManagedBackend:
            return NativeBackend(
                endpoint.worker_id,
                parse_address(endpoint.address),
                auth_token=config.auth_token,
                settings=chosen,
            )

        return build


@register_backend_kind
class OpenAIHttpKind:
    """``openai_http``: a stock ``vllm serve`` instance at ``http(s)://HOST:PORT``."""

    name: ClassVar[str] = "openai_http"

    def check_address(self, address: str, *, key: str) -> None:
        check_http_url(address, key=key)

    def open_factory(
        self, config: RouterConfig, settings: object | None
    ) -> Callable[[WorkerEndpoint, RouterConfig], ManagedBackend]:
        from ..backends.openai_http.backend import OpenAIHttpBackendFactory
        from ..backends.openai_http.settings import OpenAIHttpSettings

        chosen = settings if isinstance(settings, OpenAIHttpSettings) else config.openai_http
        factory = OpenAIHttpBackendFactory(chosen)

        def build(endpoint: WorkerEndpoint, config: RouterConfig) -> ManagedBackend:
            pool = next((p for p in config.pools if endpoint in p.workers), None)
            return factory.build(
                endpoint.worker_id,
                endpoint.address,
                model=config.model if pool is None else config.pool_model(pool),
                stage="" if pool is None else pool.stage,
            )

        return build
