"""A worker's registration in Redis: ``worker --register redis://HOST:PORT/DB``.

Theory of operation: while the worker serves, :class:`Registrar` keeps its
:class:`~epd_actors.discovery.registrations.Registration` in Redis: the
record under ``PREFIX:worker:ID`` with ``PX ttl``, its id in the pool's index
``PREFIX:workers:STAGE:MODEL``, refreshed every quarter of the TTL (so a
record outlives two missed refreshes), and at once when the worker starts to
drain (state ``draining``).  When the worker stops (drained, crashed or
cancelled) the record says ``stopped`` for one last TTL, so routers remove
it at once; a worker killed outright just stops refreshing, and its record
expires.  A router with ``[discovery] kind = "redis"`` reads these records
(:mod:`epd_actors.discovery.redis_discovery`).

Redis down, slow or refusing: the worker serves on regardless; one warning
says so (the rest at debug level until Redis answers, which one line says),
and each period tries again, so a Redis restarted empty has the record back
within a quarter TTL.  Every command is bounded by ``timeout_s``.

coredis is imported only when ``--register`` is given (the ``redis`` extra).

Cancellation: cancelling :meth:`Registrar.run` writes the ``stopped`` record
(shielded, bounded by ``timeout_s``) and returns.
Backpressure: one small write per period; nothing queues.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import trio

from ..addresses import Address, parse_address
from ..core.fleet.settings import REDIS_SCHEMES, redacted_url
from ..core.kv_settings import check_zmq_endpoint
from ..discovery.registrations import (
    Registration,
    RegistrationState,
    new_instance,
    pool_key,
    worker_key,
)
from ..errors import ConfigError

if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable

logger = logging.getLogger(__name__)

REGISTER_URL_ENV = "EPD_REGISTER_URL"
REFRESHES_PER_TTL = 4
INDEX_TTL_FACTOR = 10
_UNSPECIFIED_HOSTS = ("0.0.0.0", "::", "")


def add_registration_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--register`` options of the ``worker`` subcommand."""
    group = parser.add_argument_group("registration in Redis (routers with [discovery] kind redis)")
    group.add_argument(
        "--register",
        default=None,
        metavar="URL",
        help="keep a TTL'd registration in this Redis while serving: redis://[:PASSWORD@]HOST:"
        f"PORT/DB, rediss://... (TLS), unix://PATH (default ${REGISTER_URL_ENV}, else none)",
    )
    group.add_argument(
        "--register-stage", default=None, help="the router pool's stage (default: --role)"
    )
    group.add_argument(
        "--register-model", default=None, help="the router pool's model (default: --model)"
    )
    group.add_argument(
        "--advertise-address",
        default=None,
        metavar="ADDRESS",
        help="what routers dial, tcp://HOST:PORT or a HOST (with the bound port); "
        "needed when --listen binds 0.0.0.0 or :: (default: the bound --listen address)",
    )
    group.add_argument(
        "--register-kv-events-endpoint",
        default=None,
        metavar="ENDPOINT",
        help="where routers subscribe to this worker's KV events, tcp://HOST:PORT "
        "(default: none; the router's pool kv_events_port rule applies)",
    )
    group.add_argument(
        "--register-kv-events-replay-endpoint",
        default=None,
        metavar="ENDPOINT",
        help="where routers ask this worker's engine for KV event replays (with the above)",
    )
    group.add_argument(
        "--register-prefix", default="epd", help="Redis key prefix (default epd, as [shared])"
    )
    group.add_argument(
        "--register-ttl",
        type=float,
        default=6.0,
        metavar="SECONDS",
        help="the registration's time to live; refreshed every quarter of it (default 6)",
    )


@dataclass(frozen=True, slots=True)
class RegistrationSettings:
    """Where and how a worker registers (see the module docstring)."""

    url: str
    stage: str
    model: str
    advertise: str | None = None
    key_prefix: str = "epd"
    ttl_s: float = 6.0
    timeout_s: float = 1.0
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None

    def __post_init__(self) -> None:
        scheme = urlsplit(self.url).scheme
        if scheme not in REDIS_SCHEMES:
            raise ConfigError(
                f"--register: scheme {scheme!r} is not one of {', '.join(REDIS_SCHEMES)}"
            )
        if not (math.isfinite(self.ttl_s) and self.ttl_s > 0):
            raise ConfigError(f"--register-ttl must be a positive number, got {self.ttl_s!r}")
        if not self.key_prefix:
            raise ConfigError("--register-prefix must not be empty")
        if not self.stage or not self.model:
            raise ConfigError("--register-stage and --register-model must not be empty")
        for flag, value in (
            ("--register-kv-events-endpoint", self.kv_events_endpoint),
            ("--register-kv-events-replay-endpoint", self.kv_events_replay_endpoint),
        ):
            if value is not None:
                check_zmq_endpoint(value, key=flag)
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ConfigError(
                "--register-kv-events-replay-endpoint needs --register-kv-events-endpoint"
            )

    @property
    def refresh_s(self) -> float:
        return self.ttl_s / REFRESHES_PER_TTL

    def advertised(self, bound: Address) -> str:
        """The address routers dial, given the one bound.

        Raises:
            ConfigError: the bound address is a wildcard and none is advertised.
        """
        given = self.advertise
        if given is None:
            if bound.scheme == "tcp" and bound.host in _UNSPECIFIED_HOSTS:
                raise ConfigError(
                    f"--listen binds {bound}, which no router can dial: give --advertise-address"
                )
            return str(bound)
        if "://" in given or given.startswith("unix:"):
            return str(parse_address(given, key="--advertise-address"))
        return str(Address("tcp", host=given.strip("[]"), port=bound.port))


def registration_from_args(
    args: argparse.Namespace, *, role: str, model: str
) -> RegistrationSettings | None:
    """The registration the options ask for (None: ``--register`` not given)."""
    url = args.register or os.environ.get(REGISTER_URL_ENV, "")
    if not url:
        for name in (
            "register_stage",
            "register_model",
            "advertise_address",
            "register_kv_events_endpoint",
            "register_kv_events_replay_endpoint",
        ):
            if getattr(args, name) is not None:
                raise ConfigError(f"--{name.replace('_', '-')} needs --register")
        return None
    settings = RegistrationSettings(
        url=url,
        stage=args.register_stage or role,
        model=args.register_model or model,
        advertise=args.advertise_address,
        key_prefix=args.register_prefix,
        ttl_s=args.register_ttl,
        kv_events_endpoint=args.register_kv_events_endpoint,
        kv_events_replay_endpoint=args.register_kv_events_replay_endpoint,
    )
    given = settings.advertise
    if given is not None and ("://" in given or given.startswith("unix:")):
        parse_address(given, key="--advertise-address")
    return settings


class Registrar:
    """Keeps one worker's registration alive (see the module docstring).

    Args:
        settings: where and how.
        worker_id: the worker's id.
        address: what routers dial (:meth:`RegistrationSettings.advertised`).
        draining: whether the worker has begun to drain (read every refresh).
        backend: the routers' backend kind for this worker.
    """

    def __init__(
        self,
        settings: RegistrationSettings,
        worker_id: str,
        address: str,
        *,
        draining: Callable[[], bool] = lambda: False,
        backend: str = "native",
    ) -> None:
        self.settings = settings
        self.where = f"Redis at {redacted_url(settings.url)}"
        self.record = Registration(
            worker_id=worker_id,
            stage=settings.stage,
            model=settings.model,
            address=address,
            backend=backend,
            instance=new_instance(),
            ttl_s=settings.ttl_s,
            kv_events_endpoint=settings.kv_events_endpoint,
            kv_events_replay_endpoint=settings.kv_events_replay_endpoint,
        )
        self._draining = draining
        self._wake = trio.Event()
        self.up = False
        self.failures = 0
        self.writes = 0
        self._progress = trio.Event()

    def wake(self) -> None:
        """Refresh now (the worker's state changed)."""
        self._wake.set()

    async def wait_writes(self, count: int = 1) -> None:
        """Wait until ``count`` more refreshes succeeded."""
        target = self.writes + count
        while self.writes < target:
            await self._progress.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Refresh until cancelled; reports started after the first attempt (Redis may be down)."""
        from ..discovery.redis_client import open_redis

        started = False
        try:
            while True:
                try:
                    async with open_redis(self.settings.url, self.settings.timeout_s) as client:
                        while True:
                            await self._refresh(client)
                            if not started:
                                started = True
                                task_status.started()
                            await self._pause()
                except Exception as exc:  # could not open, or the client's own tasks failed
                    self._failed(exc)
                    if not started:
                        started = True
                        task_status.started()
                    await self._pause()
        finally:
            with trio.CancelScope(shield=True):
                await self._say_stopped()

    async def _pause(self) -> None:
        with trio.move_on_after(self.settings.refresh_s):
            await self._wake.wait()
        self._wake = trio.Event()

    def _current(self) -> Registration:
        if self._draining():
            return _with_state(self.record, RegistrationState.DRAINING)
        return self.record

    async def _refresh(self, client: Any) -> None:
        from ..discovery.redis_client import REDIS_ERRORS

        try:
            with trio.move_on_after(self.settings.timeout_s) as scope:
                await self._write(client, self._current())
        except REDIS_ERRORS as exc:
            self._failed(exc)
            return
        if scope.cancelled_caught:
            self._failed(TimeoutError(f"no answer within {self.settings.timeout_s:g} s"))
            return
        if not self.up and self.failures:
            logger.info(
                "registration of %s: %s answers again after %d failed refreshes",
                self.record.worker_id,
                self.where,
                self.failures,
            )
        self.up = True
        self.failures = 0
        self.writes += 1
        self._progress.set()
        self._progress = trio.Event()

    async def _write(self, client: Any, record: Registration) -> None:
        settings = self.settings
        ttl_ms = max(1, round(settings.ttl_s * 1000))
        index = pool_key(settings.key_prefix, record.stage, record.model)
        async with client.pipeline(transaction=False) as pipe:
            pipe.set(worker_key(settings.key_prefix, record.worker_id), record.to_json(), px=ttl_ms)
            pipe.sadd(index, [record.worker_id])
            pipe.pexpire(index, ttl_ms * INDEX_TTL_FACTOR)

    async def _say_stopped(self) -> None:
        from ..discovery.redis_client import open_redis

        stopped = _with_state(self.record, RegistrationState.STOPPED)
        with trio.move_on_after(self.settings.timeout_s):
            try:
                async with open_redis(self.settings.url, self.settings.timeout_s) as client:
                    await self._write(client, stopped)
                    return
            except Exception as exc:  # Redis away: the record expires by itself
                logger.debug("registration of %s: stopped not written: %r", stopped.worker_id, exc)

    def _failed(self, exc: BaseException) -> None:
        self.failures += 1
        if self.up or self.failures == 1:
            logger.warning(
                "registration of %s: %s is unreachable or refused (%r); the worker serves on "
                "and registers again once it answers",
                self.record.worker_id,
                self.where,
                exc,
            )
        else:
            logger.debug("registration of %s: still failing: %r", self.record.worker_id, exc)
        self.up = False


def _with_state(record: Registration, state: RegistrationState) -> Registration:
    return replace(record, state=state)
