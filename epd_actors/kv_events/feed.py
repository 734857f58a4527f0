"""Sans-IO sequencing of one worker's KV event stream: gaps, replay, restarts, state.

Theory of operation
-------------------
A publisher numbers its batches 0, 1, 2, ...; ZMQ PUB drops messages for a
subscriber that is slow or reconnecting, and a new subscriber gets no snapshot
of what the engine cached before.  :class:`FeedTracker` takes the batches one
worker's subscriber receives, in arrival order, and keeps the index right:

- **in order** (``seq == expected``): applied.
- **a gap** (``seq > expected``): the batch is held and :meth:`FeedTracker.receive`
  returns a :class:`ReplayRequest` for ``[expected, seq)``; the caller asks the
  publisher's replay socket and hands the answer to :meth:`FeedTracker.replayed`,
  which applies the missing batches, then the held one.
- **a first batch** (nothing received yet, or after a disconnect): ``seq 0``
  means the engine's whole history is ahead of us; a later ``seq`` is a gap
  from 0, replayed the same way (the publisher keeps its last batches; vLLM
  keeps 10,000), so a late subscriber catches up on what is still buffered.
- **the sequence goes back** (``seq < expected``): the engine restarted and
  counts from 0 again.  Its old blocks are gone: the worker's entries are
  purged and the batch is handled as a first one.
- **a loss** -- a gap the replay did not fill (no replay socket, a timeout, a
  buffer that no longer holds it) or a batch that does not decode: the worker's
  entries are purged (a lost ``BlockRemoved`` could otherwise leave blocks the
  engine no longer has), and what follows is applied as for a new subscriber.

What the index holds for a worker is then always a subset of the engine's
cache.  The worker's :class:`FeedState` says how complete it is:

- ``exact``: every batch since the engine's seq 0 (or its last clear) applied;
- ``degraded``: events were lost, or history before the subscription was not
  replayable; entries are true but blocks are missing.  After
  ``recovery_batches`` batches in order it is ``exact`` again: by then the
  entries that matter -- recently stored prefixes -- have come back;
- ``fallback``: no stream (nothing received yet, disconnected, stopped); the
  worker has no entries and routing uses its approximate policy for it.

Pure and synchronous: the subscriber does the I/O.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Protocol

from .decode import AllBlocksCleared

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from .decode import EventBatch, KVEvent

__all__ = [
    "RECOVERY_BATCHES",
    "FeedState",
    "FeedStatistics",
    "FeedTracker",
    "IndexWriter",
    "ReplayRequest",
]

logger = logging.getLogger(__name__)

RECOVERY_BATCHES: Final = 64
"""In-order batches after a loss before a degraded worker counts as exact again."""


class IndexWriter(Protocol):
    """What a tracker does to the index: a :class:`~.index.KVBlockIndex`, or a queue before one."""

    def apply(self, worker_id: str, events: Sequence[KVEvent]) -> None: ...

    def purge(self, worker_id: str) -> None: ...


class FeedState(enum.Enum):
    """How far the index can be trusted for one worker (see the module docstring)."""

    EXACT = "exact"
    DEGRADED = "degraded"
    FALLBACK = "fallback"


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """Ask the publisher for batches ``start`` .. ``stop - 1``."""

    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class FeedStatistics:
    """Counters of one worker's feed (totals since the tracker was built)."""

    worker_id: str
    state: FeedState
    expected_seq: int | None
    batches: int
    gaps: int
    replays_complete: int
    losses: int
    restarts: int
    decode_errors: int
    disconnects: int


class FeedTracker:
    """Sequences one worker's batches into a :class:`~.index.KVBlockIndex`.

    Args:
        worker_id: the worker the stream belongs to.
        index: where this worker's events go (the shared index, or what
            queues them for it: :class:`IndexWriter`).
        recovery_batches: in-order batches from ``degraded`` back to ``exact`` (>= 0).
    """

    def __init__(
        self, worker_id: str, index: IndexWriter, *, recovery_batches: int = RECOVERY_BATCHES
    ) -> None:
        self.worker_id = worker_id
        self._index = index
        self._recovery = max(0, recovery_batches)
        self._state = FeedState.FALLBACK
        self._expected: int | None = None  # None: the next batch is a first one
        self._countdown = 0
        self._held: tuple[int, EventBatch] | None = None
        self._pending: ReplayRequest | None = None
        self._joining = False  # the pending replay is a catch-up from 0
        self._batches = self._gaps = self._complete = self._losses = 0
        self._restarts = self._decode_errors = self._disconnects = 0

    @property
    def state(self) -> FeedState:
        return self._state

    @property
    def replay_pending(self) -> ReplayRequest | None:
        """The replay :meth:`receive` asked for and :meth:`replayed` has not answered."""
        return self._pending

    # -- the live stream

    def receive(self, seq: int, batch: EventBatch) -> ReplayRequest | None:
        """Take one live batch; returns the replay to run before the next call, if any.

        Raises:
            RuntimeError: a replay is pending (answer it with :meth:`replayed` first).
        """
        if self._pending is not None:
            raise RuntimeError("answer the pending replay before the next batch")
        if self._expected is not None and seq < self._expected:
            logger.info(
                "%s: KV event sequence went back from %d to %d: engine restarted",
                self.worker_id,
                self._expected,
                seq,
            )
            self._restarts += 1
            self._index.purge(self.worker_id)
            self._expected = None
            self._state = FeedState.FALLBACK
        if self._expected is None:
            if seq == 0:
                self._state = FeedState.EXACT
                self._apply(seq, batch)
                return None
            self._joining = True
            return self._hold(0, seq, batch)
        if seq > self._expected:
            self._gaps += 1
            self._joining = False
            return self._hold(self._expected, seq, batch)
        self._apply(seq, batch)
        return None

    def undecodable(self, seq: int | None) -> None:
        """A live message that did not decode (``seq`` when its sequence frame did)."""
        self._decode_errors += 1
        self._loss("an undecodable batch")
        if seq is not None and self._expected is not None and seq >= self._expected:
            self._expected = seq + 1

    def disconnected(self) -> None:
        """The connection to the publisher dropped: the engine may restart unseen."""
        self._disconnects += 1
        self._reset(FeedState.FALLBACK)

    def stopped(self) -> None:
        """The subscriber stopped: forget the worker's entries."""
        self._reset(FeedState.FALLBACK)

    # -- replay answers

    def replayed(self, batches: Iterable[tuple[int, EventBatch | None]] | None) -> None:
        """Answer the pending replay with what the publisher sent (None: no answer at all).

        ``batches`` are ``(seq, batch)`` in the order received; a batch of None
        did not decode.  Batches outside the requested range are ignored.
        """
        request, held = self._pending, self._held
        if request is None or held is None:
            raise RuntimeError("no replay is pending")
        self._pending = self._held = None
        got: dict[int, EventBatch | None] = {}
        for seq, batch in batches or ():
            if request.start <= seq < request.stop:
                got[seq] = batch
        missing = [s for s in range(request.start, request.stop) if got.get(s) is None]
        joining, self._joining = self._joining, False
        if missing:
            if joining:
                logger.info(
                    "%s: KV events before seq %d are not replayable; index starts incomplete",
                    self.worker_id,
                    missing[-1] + 1,
                )
            self._loss(f"{len(missing)} batches not replayed")
            first = missing[-1] + 1
        else:
            self._complete += 1
            first = request.start
            if joining:
                self._state = FeedState.EXACT
        self._expected = first
        for seq in range(first, request.stop):
            batch = got[seq]
            assert batch is not None
            self._apply(seq, batch)
        self._apply(*held)

    # -- internals

    def _hold(self, start: int, seq: int, batch: EventBatch) -> ReplayRequest:
        self._held = (seq, batch)
        self._pending = ReplayRequest(start, seq)
        if self._state is FeedState.EXACT:
            self._state = FeedState.DEGRADED
            self._countdown = 0  # back to exact as soon as the replay fills the gap
        return self._pending

    def _apply(self, seq: int, batch: EventBatch) -> None:
        self._index.apply(self.worker_id, batch.events)
        self._batches += 1
        self._expected = seq + 1
        if any(isinstance(e, AllBlocksCleared) for e in batch.events):
            self._state, self._countdown = FeedState.EXACT, 0  # the engine starts afresh
        elif self._state is FeedState.DEGRADED:
            self._countdown -= 1
            if self._countdown <= 0:
                self._state = FeedState.EXACT
        elif self._state is FeedState.FALLBACK:
            self._state, self._countdown = FeedState.DEGRADED, self._recovery

    def _loss(self, why: str) -> None:
        self._losses += 1
        logger.warning("%s: KV events lost (%s); purging its index entries", self.worker_id, why)
        self._index.purge(self.worker_id)
        self._state, self._countdown = FeedState.DEGRADED, self._recovery

    def _reset(self, state: FeedState) -> None:
        self._index.purge(self.worker_id)
        self._expected = None
        self._pending = self._held = None
        self._joining = False
        self._state = state

    def statistics(self) -> FeedStatistics:
        """A snapshot of the counters and the state."""
        return FeedStatistics(
            worker_id=self.worker_id,
            state=self._state,
            expected_seq=self._expected,
            batches=self._batches,
            gaps=self._gaps,
            replays_complete=self._complete,
            losses=self._losses,
            restarts=self._restarts,
            decode_errors=self._decode_errors,
            disconnects=self._disconnects,
        )
