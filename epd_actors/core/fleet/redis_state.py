"""The Redis store, through coredis (anyio-based, so it runs under ``trio.run``).

Keys, under ``[shared] key_prefix`` (``epd`` below):

==================  =======  ====================================================
key                 type     what
==================  =======  ====================================================
``epd:router:ID``   string   router ID's :class:`~.state.ReplicaReport` (JSON),
                             ``PX ttl_s``: gone when ID stops publishing
``epd:routers``     set      the ids that published lately (an index; ids whose
                             report expired are removed by the next reader);
                             ``PX ttl_s`` too, refreshed by every publish
``epd:admin``       stream   the admin changes (field ``change``, JSON), trimmed
                             to about ``admin_history`` entries, ``PX
                             admin_ttl_s`` refreshed by every change
==================  =======  ====================================================

A publish is two round trips (``SET``/``SADD``/``PEXPIRE``/``SMEMBERS`` in one
pipeline, then ``GET``/``PTTL`` of each listed id in another); reading the
admin changes is one ``XRANGE`` from the reader's cursor (exclusive, Redis >=
6.2).  Redis expires keys itself, so routers need no agreed clock.

coredis is an optional dependency (``pip install 'epd_actors[redis]'``):
this module is imported only when a Redis URL is configured (``store.py``).
Its own retries are off: :class:`~.sync.FleetSync` bounds each call and
retries on its next cycle.  Every Redis, socket or
timeout error becomes :class:`~.state.FleetStoreError`; an error coredis
raises from its connection tasks instead leaves :meth:`RedisFleetStore.connect`'s
block, and the sync task opens a new client.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import coredis
from coredis.exceptions import RedisError
from coredis.retry import NoRetryPolicy
from coredis.tokens import PureToken

from ...errors import ConfigError
from .changes import WorkerChange
from .settings import redacted_url
from .state import FleetStoreError, ReplicaReport

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from .settings import SharedSettings
    from .state import FleetConnection

logger = logging.getLogger(__name__)

MAX_CHANGES_PER_READ = 512
"""Admin changes one cycle reads at most (the rest come on the next cycles)."""

_ERRORS = (RedisError, OSError, TimeoutError)


class RedisFleetStore:
    """Replicas meet in one Redis (see the module docstring)."""

    def __init__(self, settings: SharedSettings) -> None:
        self.settings = settings
        self.url = settings.redis_url
        prefix = settings.key_prefix
        self._keys = _Keys(f"{prefix}:router:", f"{prefix}:routers", f"{prefix}:admin")

    def describe(self) -> str:
        return f"Redis at {redacted_url(self.url)}"

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[FleetConnection]:
        timeout = self.settings.timeout_s
        client: Any = coredis.Redis.from_url(
            self.url,
            decode_responses=True,
            decode_components=True,
            stream_timeout=timeout,
            connect_timeout=timeout,
            retry_policy=NoRetryPolicy(),
        )
        async with client:
            yield _RedisConnection(client, self._keys, self.settings)


class _Keys:
    __slots__ = ("index", "log", "report_prefix")

    def __init__(self, report_prefix: str, index: str, log: str) -> None:
        self.report_prefix = report_prefix
        self.index = index
        self.log = log

    def report(self, router_id: str) -> str:
        return self.report_prefix + router_id


class _RedisConnection:
    def __init__(self, client: Any, keys: _Keys, settings: SharedSettings) -> None:
        self._client = client
        self._keys = keys
        self._settings = settings

    async def exchange(self, report: ReplicaReport, ttl_s: float) -> list[ReplicaReport]:
        keys = self._keys
        ttl_ms = max(1, round(ttl_s * 1000))
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.set(keys.report(report.router_id), report.to_json(), px=ttl_ms)
                pipe.sadd(keys.index, [report.router_id])
                pipe.pexpire(keys.index, ttl_ms)
                members = pipe.smembers(keys.index)
            ids = sorted(await members)
            async with self._client.pipeline(transaction=False) as pipe:
                replies = [(i, pipe.get(keys.report(i)), pipe.pttl(keys.report(i))) for i in ids]
            found: list[ReplicaReport] = []
            gone: list[str] = []
            for router_id, value, ttl in replies:
                text = await value
                if text is None:
                    gone.append(router_id)
                    continue
                try:
                    found.append(
                        ReplicaReport.from_json(text, expires_in_s=max(0, await ttl) / 1e3)
                    )
                except FleetStoreError as exc:
                    logger.debug("shared state: report of %s skipped: %s", router_id, exc)
            if gone:
                await self._client.srem(keys.index, gone)
        except _ERRORS as exc:
            raise FleetStoreError(f"publish: {exc!r}") from None
        return found

    async def append_change(self, change: WorkerChange) -> None:
        log = self._keys.log
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.xadd(
                    log,
                    {"change": change.to_json()},
                    trim_strategy=PureToken.MAXLEN,
                    threshold=self._settings.admin_history,
                    trim_operator=PureToken.APPROXIMATELY,
                )
                pipe.pexpire(log, max(1, round(self._settings.admin_ttl_s * 1000)))
        except _ERRORS as exc:
            raise FleetStoreError(f"send a change: {exc!r}") from None

    async def changes_after(self, cursor: str | None) -> list[tuple[str, WorkerChange | None]]:
        start = "-" if cursor is None else f"({cursor}"
        try:
            entries = await self._client.xrange(
                self._keys.log, start, "+", count=MAX_CHANGES_PER_READ
            )
        except _ERRORS as exc:
            raise FleetStoreError(f"read changes: {exc!r}") from None
        out: list[tuple[str, WorkerChange | None]] = []
        for entry in entries:
            text = entry.field_values.get("change")
            change: WorkerChange | None = None
            try:
                change = WorkerChange.from_json(text if isinstance(text, str) else "")
            except ConfigError as exc:
                logger.warning("shared state: admin change %s skipped: %s", entry.identifier, exc)
            out.append((str(entry.identifier), change))
        return out
