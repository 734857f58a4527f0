"""Every channel capacity and default limit of epd_actors, named, with its unit and reason.

Capacities are deliberately small: a full buffer is backpressure, and overload is
refused early instead of being absorbed as memory (see docs/backpressure.md).
"""

from __future__ import annotations

from typing import Final

# Deltas one generate request may have waiting to be written to its connection
# (messages).  The sender drains the whole backlog into one frame, so this only
# bounds how far an engine may run ahead of a slow socket before it blocks.
WORKER_DELTA_BUFFER: Final = 64

# Bytes asked from the socket per receive (bytes).  Large enough that a burst of
# small frames is one syscall; a media frame simply takes several.
RECEIVE_CHUNK_BYTES: Final = 64 * 1024

# Seconds any awaited cleanup (abort to an engine, goodbye, release) may take
# inside a shielded scope before it is abandoned.
CLEANUP_TIMEOUT_S: Final = 5.0

# Seconds a new worker connection has to send its Hello.
HANDSHAKE_TIMEOUT_S: Final = 10.0

# Jobs waiting in one stage actor's inbox (jobs).  A full inbox makes the
# submitting request wait (under its deadline): backpressure, not memory.
ACTOR_INBOX_CAPACITY: Final = 64

# Jobs one stage actor runs at once (jobs).  Far above what its workers take;
# it exists so that a flood cannot create unbounded tasks.
ACTOR_MAX_JOBS: Final = 4096

# Stage events (deltas, results) buffered between a job and its request
# (events).  The job blocks when its request's consumer falls behind.
JOB_REPLY_BUFFER: Final = 32

# Events buffered between a request's pipeline and its caller (events).
REQUEST_EVENT_BUFFER: Final = 32

# Connections the router's HTTP listener takes per wake-up of its accept loop
# (connections).  Trio's accept yields to the scheduler after each connection;
# with thousands of streams open a scheduling round is long, so one connection
# per round lets the kernel's backlog fill and new clients stall in SYN retries.
ACCEPT_BURST: Final = 256
