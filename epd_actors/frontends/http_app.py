"""What the HTTP front end serves and how it is bounded: settings and the app protocol.

:class:`HttpApp` is all the server needs from a router -- ``generate`` plus the
models, health, metrics and admin hooks -- so tests drive the server with
fakes; :class:`RouterHttpApp` adapts a running
:class:`~epd_actors.core.router.Router`.  :class:`HttpSettings` holds every limit
and timeout of the front end, with units; docs/http.md has the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Protocol

from ..core.fleet.view import fleet_view
from ..openai.coalescing import check_stream_coalescing
from ..openai.fields import STRICT_FIELDS, FieldPolicy
from ..openai.media import MediaLimits
from .cors import CorsPolicy

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence
    from contextlib import AbstractAsyncContextManager

    from ..core.models import ModelCard
    from ..core.router import Router
    from ..handoff import HandoffReceiver
    from ..request import GenerationEvent, GenerationRequest

    AdminHook = Callable[[str, str, object], Awaitable[tuple[int, object]]]
    """``await admin(method, path, json_body)`` -> ``(status, json_body)``."""

KIB: Final = 1024
MIB: Final = 1024 * KIB


@dataclass(frozen=True, slots=True)
class HttpSettings:
    """Limits, timeouts and keys of the HTTP front end (docs/http.md has the table).

    Attributes:
        api_keys: accepted ``Authorization: Bearer`` keys for ``/v1/*``; empty = open.
        admin_keys: keys for ``/admin/*``; empty = admin routes disabled (404).
        max_body_bytes: largest request body (413 above, before reading it).
        max_header_bytes: largest request head (431 above).
        keep_alive_timeout_s: idle time allowed between requests, and for a
            request head to arrive (seconds).
        body_timeout_s: time to receive one request body (408 after; seconds).
        write_timeout_s: time one write to the client may take (seconds);
            a slower client is dropped and its request cancelled.
        linger_s: after the last response on a connection, how long to wait
            for the client's EOF before closing (so a client still sending,
            e.g. after a 413, reads the answer instead of a reset; seconds).
        max_connections: concurrent connections; more get a canned 503.
        receive_bytes: bytes asked of the socket per read.
        max_pipelined_bytes: bytes of the client's next requests buffered while
            a response streams; beyond it, the server stops reading until the
            response is done.
        access_log: log one INFO line per request.
        media: media limits and the URL/path allow-list.
        fields: what to do with request fields the router does not know
            (:class:`~epd_actors.openai.fields.FieldPolicy`: refused by default).
        cors: the origins browsers may call from (:mod:`.cors`; none by default).
        stream_coalescing: ``ready`` (merge the deltas already queued into one
            SSE event) or ``off`` (one SSE event per delta); set from ``[server]
            stream_coalescing`` (:mod:`~epd_actors.openai.coalescing`).
    """

    api_keys: tuple[str, ...] = field(default=(), repr=False)
    admin_keys: tuple[str, ...] = field(default=(), repr=False)
    max_body_bytes: int = 48 * MIB
    max_header_bytes: int = 16 * KIB
    keep_alive_timeout_s: float = 5.0
    body_timeout_s: float = 30.0
    write_timeout_s: float = 30.0
    linger_s: float = 1.0
    max_connections: int = 1024
    receive_bytes: int = 64 * KIB
    max_pipelined_bytes: int = 64 * KIB
    access_log: bool = False
    media: MediaLimits = field(default_factory=MediaLimits)
    fields: FieldPolicy = STRICT_FIELDS
    cors: CorsPolicy = field(default_factory=CorsPolicy)
    stream_coalescing: str = "ready"

    def __post_init__(self) -> None:
        check_stream_coalescing(self.stream_coalescing, key="server.stream_coalescing")


class HttpApp(Protocol):
    """What the HTTP front end needs from a router (tests pass fakes).

    Attributes:
        admin: ``await admin(method, path, json_body)`` -> ``(status, json)`` for
            ``/admin/*``; None disables the admin routes (404).
    """

    admin: AdminHook | None

    def generate(
        self, request: GenerationRequest
    ) -> AbstractAsyncContextManager[HandoffReceiver[GenerationEvent]]:
        """Run a request; the block yields its events (last: Done or Error).

        The front end may attach a writer to the channel (see :mod:`~epd_actors.handoff`).
        """
        ...

    def models(self) -> Sequence[str | ModelCard]:
        """The models served (``/v1/models``; requests must name one).

        A plain name is a model; a :class:`~epd_actors.core.models.ModelCard` may
        name a LoRA adapter's ``parent`` model.
        """
        ...

    def serves(self, model: str) -> bool:
        """Whether a request may name ``model``: one of :meth:`models` (asked per request)."""
        ...

    def health(self) -> tuple[int, dict[str, object]]:
        """``(status, body)`` of ``/health``."""
        ...

    def metrics(self) -> str | bytes:
        """The Prometheus text exposition (``/metrics``)."""
        ...

    def observe_http(self, route: str, status: int) -> None:
        """Count one answered request (``route`` is a known path or ``other``)."""
        ...


class RouterHttpApp:
    """:class:`HttpApp` over a running :class:`~epd_actors.core.router.Router`.

    ``health`` is 200 only when every pool has a usable worker and the router
    is not draining; its body lists each pool's workers and their state
    (``refused``: why the router refuses a worker that announced a role or
    model its pool cannot use, else null).  :attr:`draining` is set when the
    router begins to stop, before its listeners close, so that load balancers
    reading ``/health`` or ``/readyz`` move traffic away first.
    """

    def __init__(self, router: Router) -> None:
        self.router = router
        self.admin: AdminHook | None = None
        self.draining = False

    def generate(
        self, request: GenerationRequest
    ) -> AbstractAsyncContextManager[HandoffReceiver[GenerationEvent]]:
        return self.router.generate(request)

    def models(self) -> Sequence[str | ModelCard]:
        """Every model the pools serve, then every LoRA adapter (configured or announced)."""
        return self.router.model_cards()

    def serves(self, model: str) -> bool:
        return self.router.serves_model(model)

    def health(self) -> tuple[int, dict[str, object]]:
        stats = self.router.statistics()
        pools: dict[str, object] = {}
        healthy = True
        for stage, members in stats.pools.items():
            usable = sum(member.usable for member in members)
            healthy = healthy and usable > 0
            pools[stage] = {
                "usable": usable,
                "workers": [
                    {
                        "id": m.worker_id,
                        "usable": m.usable,
                        "connected": m.connected,
                        "draining": m.draining,
                        "in_flight": m.in_flight,
                        "served": m.served,
                        "breaker": m.breaker,
                        "aborts_sent": m.aborts_sent,
                        "worker_aborts": m.worker_aborts,
                        "refused": m.refused,
                        "limit": m.limit,
                    }
                    for m in members
                ],
            }
        status = "draining" if self.draining else "ok" if healthy else "unavailable"
        body: dict[str, object] = {
            "status": status,
            "requests_in_flight": stats.supervisor.requests_in_flight,
            "pools": pools,
        }
        if self.router.fleet is not None:
            body["fleet"] = fleet_view(self.router.fleet)
        return (200 if status == "ok" else 503), body

    def metrics(self) -> str | bytes:
        return self.router.metrics.render()

    def observe_http(self, route: str, status: int) -> None:
        self.router.metrics.observe_http(route, status)
