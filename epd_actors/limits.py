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
