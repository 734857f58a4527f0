"""One coredis client for the registrations (worker side and router side).

coredis is built on anyio, so it runs under ``trio.run``; a client is used as
an async context manager (its connections run in a task group, a Trio nursery
here).  Its own retries are off: the callers bound every command with
``timeout_s`` and try again on their next period.  The URL forms are those of
``[shared] redis_url``: ``redis://[[user]:password@]host:port/db``,
``rediss://...`` (TLS; ``?ssl_ca_certs=PATH`` names a private CA) and
``unix://[:password@]/path.sock``.

Imported only when registrations are used (``pip install 'epd_actors[redis]'``).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import coredis
from coredis.exceptions import RedisError
from coredis.retry import NoRetryPolicy

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

REDIS_ERRORS: tuple[type[BaseException], ...] = (RedisError, OSError, TimeoutError)
"""What a command may raise when Redis is away, slow or refuses."""


@asynccontextmanager
async def open_redis(url: str, timeout_s: float) -> AsyncIterator[Any]:
    """A client of ``url`` for the block (each command bounded by ``timeout_s``).

    An error of coredis's own connection tasks (a failed TLS handshake, say)
    leaves this block rather than the command: callers open a new client then.
    """
    client: Any = coredis.Redis.from_url(
        url,
        decode_responses=True,
        decode_components=True,
        stream_timeout=timeout_s,
        connect_timeout=timeout_s,
        retry_policy=NoRetryPolicy(),
    )
    async with client:
        yield client
