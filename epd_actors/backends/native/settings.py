"""Deadlines, capacities and counters of one native worker connection.

:class:`NativeSettings` with its checks, :data:`DEFAULT_SETTINGS`, and the
:class:`NativeBackendStatistics` snapshot that ``NativeBackend.statistics`` returns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...errors import ConfigError
from ...protocol import DEFAULT_MAX_FRAME_BYTES

_DURATIONS = (
    "connect_timeout_s",
    "handshake_timeout_s",
    "heartbeat_interval_s",
    "heartbeat_timeout_s",
    "reconnect_backoff_start_s",
    "reconnect_backoff_max_s",
    "abort_timeout_s",
    "write_timeout_s",
)
_COUNTS = ("request_buffer", "write_queue_frames", "write_queue_bytes", "max_frame_bytes")


@dataclass(frozen=True, slots=True)
class NativeSettings:
    """Deadlines and capacities of one native worker connection.

    Attributes:
        connect_timeout_s: how long one dial may take (seconds).
        handshake_timeout_s: how long the worker has to answer ``Hello`` (seconds).
        heartbeat_interval_s: time between two ``Ping``s (seconds).
        heartbeat_timeout_s: no ``Pong`` for this long and the connection is
            declared dead (seconds); must exceed the interval.
        reconnect_backoff_start_s: the wait before the first reconnect
            (seconds); it doubles after each failed attempt.
        reconnect_backoff_max_s: the longest wait, also used after a rejected
            handshake (seconds).
        reconnect_jitter: the random share of each wait: a wait of ``b`` is
            ``b * (1 - jitter * U[0, 1))``; 0 disables jitter.
        request_buffer: replies one request may have waiting for its reader
            (messages).  The worker merges queued tokens into one frame, so a
            consumer this far behind is stuck or broken, not slow: it fails with
            ``StreamOverrun`` rather than stall the connection's only reader.
        abort_timeout_s: how long cleanup waits for ``Aborted`` (seconds).
        write_timeout_s: how long the connection's writer may take to write one
            batch of frames (one ``send_all``) before the connection is given up
            as stuck (seconds).  Time a frame spends queued does not count.
        write_queue_frames: request frames queued for the connection's writer
            at most (frames); a request that finds the queue full waits, under
            its own deadline, until the writer takes the queue.  ``Ping`` and
            ``Abort`` frames are not counted and never wait.
        write_queue_bytes: bytes of request frames queued at most (bytes); a
            frame larger than this is still queued when the queue is empty.
        max_frame_bytes: frame limit in both directions (bytes).
        merge_reads: the deltas of one stream that one read of the socket
            brought are handed on as one delta (when the merge keeps
            everything); False: one by one, as the worker framed them
            (``[server] stream_coalescing = "off"`` sets it).
    """

    connect_timeout_s: float = 5.0
    handshake_timeout_s: float = 5.0
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 3.0
    reconnect_backoff_start_s: float = 0.1
    reconnect_backoff_max_s: float = 5.0
    reconnect_jitter: float = 0.5
    request_buffer: int = 256
    abort_timeout_s: float = 2.0
    write_timeout_s: float = 10.0
    write_queue_frames: int = 1024
    write_queue_bytes: int = 8 * 1024 * 1024
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    merge_reads: bool = True

    def __post_init__(self) -> None:
        for name in _DURATIONS:
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        if self.reconnect_backoff_max_s < self.reconnect_backoff_start_s:
            raise ConfigError("reconnect_backoff_max_s must be >= reconnect_backoff_start_s")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError("heartbeat_timeout_s must be longer than heartbeat_interval_s")
        if not 0.0 <= self.reconnect_jitter <= 1.0:
            raise ConfigError(f"reconnect_jitter must be in [0, 1], got {self.reconnect_jitter!r}")
        for name in _COUNTS:
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")


DEFAULT_SETTINGS = NativeSettings()


@dataclass(frozen=True, slots=True)
class NativeBackendStatistics:
    """A snapshot of one backend's counters.

    Attributes:
        in_flight: registered requests (stage, stream and release).
        connects: handshakes that succeeded.
        connect_failures: attempts that failed before a ``Welcome`` (not rejections).
        handshake_rejections: attempts the worker refused.
        refusals: welcomed attempts this router refused (the worker announced
            a role, model or ``max_concurrency`` its pool cannot use).
        disconnects: welcomed connections that ended.
        overruns: requests failed with ``StreamOverrun``.
        aborts_sent: ``Abort`` frames queued or written.
        writes: ``send_all`` calls of the connection writers (each writes every
            frame queued at the time).
        frames_written: frames those writes carried.
        last_rtt_s: round trip of the latest answered ``Ping``.
        role, model: from the latest ``Welcome``.
    """

    worker_id: str
    connected: bool
    draining: bool
    in_flight: int
    connects: int
    connect_failures: int
    handshake_rejections: int
    disconnects: int
    overruns: int
    aborts_sent: int
    last_rtt_s: float | None
    role: str | None
    model: str | None
    writes: int = 0
    frames_written: int = 0
    refusals: int = 0
