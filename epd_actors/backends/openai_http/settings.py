"""Settings, counters and the pure state of the ``openai_http`` backend.

:class:`OpenAIHttpSettings` (timeouts, pool limits, health probing, the KV
release policy) with its checks; :class:`OpenAIHttpStatistics`; the
:class:`Hysteresis` that turns health probes into up/down; and the
:class:`HandoffLedger`, which remembers P's KV hand-offs that no decoder has
received yet, so that a request cancelled between P and D can have its blocks
consumed (``release_policy = "consume"``).  Nothing here does I/O; time is
passed in.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Protocol

from ...errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ..base import BackendStatus

RELEASE_POLICIES: Final = ("expire", "consume")
"""How ``release`` treats a KV hand-off nobody decoded (docs/reliability.md)."""

_DURATIONS: Final = (
    "connect_timeout_s",
    "read_timeout_s",
    "write_timeout_s",
    "pool_timeout_s",
    "keepalive_expiry_s",
    "health_interval_s",
    "health_timeout_s",
    "kv_lease_s",
    "lora_load_timeout_s",
)
_COUNTS: Final = (
    "max_connections",
    "max_keepalive_connections",
    "failures_to_down",
    "successes_to_up",
    "max_response_bytes",
    "max_event_bytes",
    "ledger_capacity",
)


@dataclass(frozen=True, slots=True)
class OpenAIHttpSettings:
    """Timeouts, limits and policies of the backends that talk to ``vllm serve``.

    Attributes:
        connect_timeout_s: one TCP (and TLS) connect (seconds).
        read_timeout_s: the longest wait for the next bytes of a reply
            (seconds).  A prefill sends nothing until it is done, so this bounds
            a whole prefill; the router's first- and inter-token deadlines
            bound streams more tightly.
        write_timeout_s: sending one request body (seconds).
        pool_timeout_s: waiting for a free connection of the pool (seconds).
        max_connections: connections to one worker at once (connections);
            ``max_in_flight_per_worker`` of the pool should not exceed it.
        max_keepalive_connections: idle connections kept for reuse; as many
            as ``max_connections`` by default, so a burst of streams ending
            together does not close connections the next burst opens again
            (``keepalive_expiry_s`` still closes those left unused).
        keepalive_expiry_s: an idle connection older than this is closed
            (seconds).  Below vLLM's ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` (5 s by
            default), so the router never reuses a connection the server is
            closing at that moment.
        health_interval_s: time between two ``GET /health`` probes (seconds).
        health_timeout_s: one probe's deadline (seconds).
        failures_to_down: failed probes in a row that take a worker down.
        successes_to_up: passed probes in a row that bring it back.
        max_response_bytes: the largest non-streamed reply read (bytes).
        max_event_bytes: the largest server-sent event of a stream (bytes).
        return_token_ids: ask vLLM for sampled token ids (``return_token_ids``).
        api_key: sent as ``Authorization: Bearer`` (vLLM's ``--api-key``); never logged.
        release_policy: ``expire`` (release does nothing; P's connector frees
            the blocks when its lease runs out) or ``consume`` (a decoder is
            sent a one-token request that pulls them).  See docs/reliability.md.
        kv_lease_s: how long P holds unclaimed blocks (NIXL's
            ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, seconds); past it a hand-off
            is not consumed, since the blocks may belong to someone else by then.
        ledger_capacity: hand-offs remembered for ``consume`` (oldest dropped).
        lora_load_timeout_s: one run-time LoRA adapter load
            (``POST /v1/load_lora_adapter``; seconds); past it the request
            moves to another worker (``AdapterLoadFailed``).
        merge_reads: the SSE chunks of one network read are handed on as
            one delta; False: one delta per chunk, as vLLM sent them
            (``[server] stream_coalescing = "off"`` sets it).
        relay_engine_text: a stream chunk of only text (and token ids) is
            recognised without a JSON parse, and its text goes to an SSE
            client as vLLM encoded it (:mod:`.relay`); False: every chunk
            is parsed, and the text encoded again.
        shared_stream_reader: one task per backend reads the sockets of all
            its open streams while their readers wait, and hands the deltas
            on there (:class:`~epd_actors.transport.read_hub.ReadHub`; Linux,
            plain HTTP); False, or over TLS: each stream's reader reads its
            own socket.
    """

    connect_timeout_s: float = 5.0
    read_timeout_s: float = 300.0
    write_timeout_s: float = 30.0
    pool_timeout_s: float = 10.0
    max_connections: int = 512
    max_keepalive_connections: int = 512
    keepalive_expiry_s: float = 4.0
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    failures_to_down: int = 2
    successes_to_up: int = 1
    max_response_bytes: int = 16 * 1024 * 1024
    max_event_bytes: int = 4 * 1024 * 1024
    return_token_ids: bool = True
    api_key: str | None = field(default=None, repr=False)
    release_policy: str = "expire"
    kv_lease_s: float = 480.0
    ledger_capacity: int = 4096
    lora_load_timeout_s: float = 60.0
    merge_reads: bool = True
    relay_engine_text: bool = True
    shared_stream_reader: bool = True

    def __post_init__(self) -> None:
        for name in _DURATIONS:
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ConfigError(f"openai_http.{name} must be a positive number of seconds")
        for name in _COUNTS:
            value = getattr(self, name)
            if not (type(value) is int and value >= 1):
                raise ConfigError(f"openai_http.{name} must be a positive integer")
        if self.release_policy not in RELEASE_POLICIES:
            raise ConfigError(
                f"openai_http.release_policy must be one of {', '.join(RELEASE_POLICIES)}"
            )


DEFAULT_SETTINGS: Final = OpenAIHttpSettings()


@dataclass(frozen=True, slots=True)
class OpenAIHttpStatistics:
    """A snapshot of one backend's counters.

    Attributes:
        in_flight: HTTP requests open now (stage calls, streams, consumes).
        probes / probe_failures: health probes sent / not answered 200.
        requests / request_failures: stage calls and streams / those that failed.
        releases_expired: releases left to P's lease (``expire``, or nothing to consume).
        releases_consumed: hand-offs a decoder pulled on our behalf.
    """

    worker_id: str
    connected: bool
    ready: bool
    in_flight: int
    probes: int
    probe_failures: int
    requests: int
    request_failures: int
    releases_expired: int
    releases_consumed: int


class Hysteresis:
    """Up/down from a series of observations: N failures to go down, M successes to come up.

    Starts down.  :meth:`force_down` takes it down at once (a request could
    not even connect); it then needs M successes like any other fall.
    """

    __slots__ = ("_failures", "_successes", "failures_to_down", "successes_to_up", "up")

    def __init__(self, *, failures_to_down: int, successes_to_up: int) -> None:
        self.failures_to_down = failures_to_down
        self.successes_to_up = successes_to_up
        self.up = False
        self._failures = 0
        self._successes = 0

    def observe(self, ok: bool) -> bool:
        """Record one observation; True when the state changed."""
        if ok:
            self._failures = 0
            self._successes += 1
            if not self.up and self._successes >= self.successes_to_up:
                self.up = True
                return True
            return False
        self._successes = 0
        self._failures += 1
        if self.up and self._failures >= self.failures_to_down:
            self.up = False
            return True
        return False

    def force_down(self) -> bool:
        """Go down now; True when the state changed."""
        self._successes = 0
        changed, self.up = self.up, False
        return changed


# ---------------------------------------------------------------- the hand-off ledger


@dataclass(frozen=True, slots=True)
class Replay:
    """A decode request that would consume one hand-off.

    Attributes:
        path: the endpoint of the original request.
        body: the one-token, non-streamed decode body (P's params included).
        request_id: the ``x-request-id`` of P and D.
        recorded_at: when P answered (router clock).
    """

    path: str
    body: dict[str, object]
    request_id: str
    recorded_at: float


class Consumer(Protocol):
    """A decode backend the ledger can send a :class:`Replay` to."""

    worker_id: str

    def status(self) -> BackendStatus:
        """Current state (no I/O)."""
        ...

    async def consume(self, replay: Replay) -> bool:
        """Send the replay; True once the decoder has answered it."""
        ...


def handoff_key(kv_transfer_params: Mapping[str, object]) -> str:
    """A stable key of one hand-off: its parameters as canonical JSON."""
    return json.dumps(kv_transfer_params, sort_keys=True, separators=(",", ":"), default=repr)


class HandoffLedger:
    """P's KV hand-offs no decoder has received yet, and decoders that could consume them.

    Shared by the ``openai_http`` backends of one router: P records a hand-off
    when it answers, D marks it delivered once a decoder accepted the request
    (from then on vLLM frees the blocks itself, also when D is aborted), and a
    release takes what is left.  Bounded: at most ``capacity`` entries (the
    oldest is dropped), and an entry older than ``lease_s`` is never returned.

    Args:
        capacity: entries kept.
        lease_s: the lease after which P's connector frees the blocks anyway.
    """

    __slots__ = ("_consumers", "_cursor", "_entries", "capacity", "dropped", "lease_s")

    def __init__(self, *, capacity: int, lease_s: float) -> None:
        self.capacity = capacity
        self.lease_s = lease_s
        self._entries: OrderedDict[str, Replay] = OrderedDict()
        self._consumers: dict[str, Consumer] = {}
        self._cursor = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, kv_transfer_params: Mapping[str, object], replay: Replay) -> None:
        """Remember a hand-off until it is delivered, taken, expired or crowded out."""
        self._entries[handoff_key(kv_transfer_params)] = replay
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
            self.dropped += 1

    def delivered(self, kv_transfer_params: Mapping[str, object]) -> bool:
        """A decoder accepted the hand-off; forget it.  True if it was remembered."""
        return self._entries.pop(handoff_key(kv_transfer_params), None) is not None

    def take(self, kv_transfer_params: Mapping[str, object], now: float) -> Replay | None:
        """The replay of an undelivered hand-off still within its lease, removing it."""
        replay = self._entries.pop(handoff_key(kv_transfer_params), None)
        if replay is None or now - replay.recorded_at >= self.lease_s:
            return None
        return replay

    def add_consumer(self, consumer: Consumer) -> None:
        """Let ``consumer`` (a decode backend) consume hand-offs; idempotent."""
        self._consumers[consumer.worker_id] = consumer

    def remove_consumer(self, consumer: Consumer) -> None:
        """Stop offering hand-offs to ``consumer`` (a stopped backend); idempotent."""
        if self._consumers.get(consumer.worker_id) is consumer:
            del self._consumers[consumer.worker_id]

    def pick_consumer(self) -> Consumer | None:
        """The next ready consumer, round robin; None when no decoder is ready."""
        ready = [c for c in self._consumers.values() if _usable(c.status())]
        if not ready:
            return None
        self._cursor = (self._cursor + 1) % len(ready)
        return ready[self._cursor]


def _usable(status: BackendStatus) -> bool:
    return status.connected and status.ready and not status.draining
