"""The simulator's KV event publisher: vLLM's exact wire format over ZMQ PUB + ROUTER replay.

Theory of operation
-------------------
:func:`encode_batch` writes an ``EventBatch`` the way vLLM's msgspec structs
do (``vllm/distributed/kv_events.py``): the batch as ``[ts, events,
data_parallel_rank]`` and each event either

- ``"array"`` (vLLM before PR #42892): ``[tag, field...]`` in declaration
  order, trailing fields at their default omitted (msgspec ``array_like`` with
  ``omit_defaults``), or
- ``"map"`` (vLLM after it): ``{"type": tag, field: value...}``, fields at
  their default omitted.

:class:`SimKVEventPublisher` is ``ZmqEventPublisher``'s behaviour: a PUB
socket sending ``[topic, seq (8 bytes big-endian), payload]`` with ``seq``
counting from 0 per publisher (a restarted engine starts again at 0), a
buffer of the last ``buffer_steps`` batches, and a ROUTER socket answering a
DEALER's ``[b"", start seq]`` with ``[b"", seq, payload]`` for every buffered
batch from ``start`` on, then ``[b"", -1, b""]``.

:meth:`SimKVEventPublisher.publish` is called from the engine (the Trio
thread) and never blocks: it numbers and encodes the batch and puts it on a
bounded queue (``max_queue`` batches; a batch that does not fit is dropped and
counted, leaving a gap subscribers see and cannot replay, as a lost batch would).
One thread owns both sockets: it sends queued batches and serves replay
requests, polling every ``poll_interval_s``.  pyzmq is the optional
``kv-events`` extra, imported when a publisher is built.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
from collections import deque
from typing import TYPE_CHECKING, Any, Final

import msgpack
import prometheus_client
import trio

from ..errors import ConfigError
from ..kv_events.decode import AllBlocksCleared, BlockRemoved, BlockStored
from ..kv_events.zmq_import import import_zmq
from .prefix_cache import PrefixCacheCollector

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from prometheus_client.registry import CollectorRegistry

    from ..kv_events.decode import KVEvent
    from .engine import SimEngine

__all__ = [
    "ENCODINGS",
    "SimKVEventPublisher",
    "encode_batch",
    "encode_event",
    "sim_worker_kv_events",
]

logger = logging.getLogger(__name__)

ENCODINGS: Final = ("array", "map")
"""The event encodings :func:`encode_batch` writes."""

_END: Final = (-1).to_bytes(8, "big", signed=True)


def _stored_fields(e: BlockStored) -> list[tuple[str, object, bool]]:
    """(name, value, has a default) in vLLM's declaration order."""
    extra = None if e.extra_keys is None else [None if k is None else list(k) for k in e.extra_keys]
    return [
        ("block_hashes", list(e.block_hashes), False),
        ("parent_block_hash", e.parent_block_hash, False),
        ("token_ids", list(e.token_ids), False),
        ("block_size", e.block_size, False),
        ("lora_id", e.lora_id, False),
        ("medium", e.medium, False),
        ("lora_name", e.lora_name, False),
        ("extra_keys", extra, True),
        ("group_idx", e.group_idx, True),
    ]


def _fields(event: KVEvent) -> tuple[str, list[tuple[str, object, bool]]]:
    if isinstance(event, BlockStored):
        return "BlockStored", _stored_fields(event)
    if isinstance(event, BlockRemoved):
        return "BlockRemoved", [
            ("block_hashes", list(event.block_hashes), False),
            ("medium", event.medium, False),
            ("group_idx", event.group_idx, True),
        ]
    if isinstance(event, AllBlocksCleared):
        return "AllBlocksCleared", []
    raise TypeError(f"not a KV event: {event!r}")


def encode_event(event: KVEvent, encoding: str) -> object:
    """One event as msgspec would write it (a list or a dict, before msgpack)."""
    tag, fields = _fields(event)
    if encoding == "map":
        out: dict[str, object] = {"type": tag}
        out.update(
            (name, value) for name, value, default in fields if not (default and value is None)
        )
        return out
    if encoding == "array":
        while fields and fields[-1][2] and fields[-1][1] is None:
            fields.pop()  # omit_defaults drops trailing defaults only
        return [tag, *(value for _, value, _ in fields)]
    raise ConfigError(f"KV event encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}")


def encode_batch(
    events: Sequence[KVEvent], *, ts: float, encoding: str = "map", data_parallel_rank: int = 0
) -> bytes:
    """The msgpack payload of one ``EventBatch``."""
    body = [ts, [encode_event(e, encoding) for e in events], data_parallel_rank]
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return packed


class SimKVEventPublisher:
    """Publishes KV event batches like vLLM's ``ZmqEventPublisher`` (see the module docstring).

    Args:
        endpoint: the PUB address to bind, e.g. ``tcp://127.0.0.1:5557``
            (``tcp://127.0.0.1:*`` picks a free port; :attr:`endpoint` says which).
        replay_endpoint: the ROUTER address to bind, or None for no replay.
        topic: the topic frame of every message.
        encoding: ``"array"`` or ``"map"``.
        buffer_steps: batches kept for replay.
        max_queue: batches queued for the thread before new ones are dropped.
        poll_interval_s: how often the thread looks for work when idle.

    Raises:
        ConfigError: a bad encoding, pyzmq missing, or an address that cannot be bound.

    Use as a context manager: the sockets are bound on entry, the thread
    stopped and the sockets closed on exit (queued batches are sent first).
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        encoding: str = "map",
        buffer_steps: int = 10_000,
        max_queue: int = 100_000,
        poll_interval_s: float = 0.02,
        data_parallel_rank: int = 0,
    ) -> None:
        if encoding not in ENCODINGS:
            raise ConfigError(
                f"KV event encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}"
            )
        self._zmq = import_zmq()
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.encoding = encoding
        self._topic = topic.encode("utf-8")
        self._rank = data_parallel_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=max(1, buffer_steps))
        self._queue: queue.Queue[tuple[int, bytes] | None] = queue.Queue(maxsize=max(1, max_queue))
        self._poll_s = poll_interval_s
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._pub: Any = None
        self._router: Any = None
        self.numbered = 0  # batches given a sequence number (published or dropped)
        self.published = 0
        self.dropped = 0
        self.replays_served = 0

    def __enter__(self) -> SimKVEventPublisher:
        zmq = self._zmq
        ctx = zmq.Context.instance()
        try:
            self._pub = ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(self.endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if self.replay_endpoint is not None:
                self._router = ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self._router.bind(self.replay_endpoint)
                self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ConfigError(f"KV events: cannot bind {self.endpoint}: {e}") from None
        self._thread = threading.Thread(target=self._run, name="sim-kv-events", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Send what is queued, stop the thread, close the sockets (idempotent; blocks briefly)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Number, encode and queue one batch; never blocks (a full queue drops it)."""
        seq = next(self._seq)
        self.numbered = seq + 1
        ts = trio.current_time() if trio.lowlevel.in_trio_run() else 0.0
        payload = encode_batch(events, ts=ts, encoding=self.encoding, data_parallel_rank=self._rank)
        try:
            self._queue.put_nowait((seq, payload))
        except queue.Full:
            self.dropped += 1
            logger.warning("KV event batch %d dropped: the publisher queue is full", seq)

    # -- the thread

    def _run(self) -> None:
        zmq = self._zmq
        while True:
            if self._router is not None:
                while self._router.poll(0):
                    self._serve_replay()
            try:
                item = self._queue.get(timeout=self._poll_s)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, payload = item
            try:
                self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
            except zmq.ZMQError as e:
                logger.warning("KV event batch %d not sent: %s", seq, e)
            self._buffer.append((seq, payload))
            self.published += 1

    def _serve_replay(self) -> None:
        frames = self._router.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignoring a malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start_frame = frames
        start = int.from_bytes(start_frame, "big", signed=True)
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
        self._router.send_multipart([client, b"", _END, b""])
        self.replays_served += 1


@contextlib.contextmanager
def sim_worker_kv_events(
    engine: SimEngine, *, registry: CollectorRegistry | None = None
) -> Iterator[SimKVEventPublisher | None]:
    """What a simulated worker process adds for its prefix cache: metrics and KV events.

    Registers the cache's counters (``epd_sim_prefix_cache_*``) in ``registry``
    (default: the process's, which ``--metrics-listen`` serves) and, with
    ``kv_events_endpoint`` set, publishes the cache's events there for the
    duration of the block, announcing the bound addresses on stdout.

    Raises:
        ConfigError: KV events asked for without a prefix cache, a bad address,
            pyzmq missing.
    """
    config, cache = engine.config, engine.prefix_cache
    if config.kv_events_endpoint is not None and cache is None:
        raise ConfigError(
            "--sim-kv-events-endpoint needs --sim-prefix-cache-blocks > 0 on a role that prefills"
        )
    if cache is None:
        yield None
        return
    target = registry if registry is not None else prometheus_client.REGISTRY
    collector = PrefixCacheCollector(cache, engine.worker_id)
    target.register(collector)
    try:
        if config.kv_events_endpoint is None:
            yield None
            return
        publisher = SimKVEventPublisher(
            config.kv_events_endpoint,
            config.kv_events_replay_endpoint,
            topic=config.kv_events_topic,
            encoding=config.kv_events_encoding,
        )
        with publisher:
            cache.sink = publisher
            replay = f", replay on {publisher.replay_endpoint}" if publisher.replay_endpoint else ""
            print(
                f"epd_actors worker {engine.worker_id} KV events on {publisher.endpoint}{replay}",
                flush=True,
            )
            try:
                yield publisher
            finally:
                cache.sink = None
    finally:
        target.unregister(collector)
