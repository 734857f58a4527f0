"""A backend that runs an engine inside the router's own process (no sockets).

Useful to embed a simulated fleet in a Trio program or a test: the stage
actors, pools and supervisor behave exactly as with remote workers, while
the engine's methods are called directly.  ``disconnect()`` / ``reconnect()``
and ``draining`` let tests flip the worker's state.

Cancellation: a cancelled stage call or a stream left early calls
``engine.abort(request_id)`` inside a shielded, bounded scope, as a remote
worker would on ``Abort``.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import trio

from .._groups import single_exception
from ..errors import EngineCrashed, EngineError, RemoteWorkerError, WorkerDisconnected
from ..handoff import HandoffReceiver, HandoffSender, open_handoff
from ..limits import CLEANUP_TIMEOUT_S, WORKER_DELTA_BUFFER
from ..lora import announced_adapters
from ..protocol import Delta, EncodeRequest, PrefillRequest
from ..worker.engine import check_options
from .base import BackendStatus, WorkerRequirement

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

    from ..protocol import GenerateRequest, StageResult
    from ..worker.engine import Engine

logger = logging.getLogger(__name__)


class _EngineStream:
    """The deltas of one in-process generate call."""

    def __init__(self, backend: InProcessBackend, request_id: str) -> None:
        self._backend = backend
        self._request_id = request_id
        self.channel: HandoffReceiver[Delta] | None = None
        self.error: BaseException | None = None
        self.finished = False

    async def receive(self) -> Delta:
        assert self.channel is not None
        if self.finished:
            raise trio.EndOfChannel
        try:
            delta = await self.channel.receive()
        except trio.EndOfChannel:
            raise self._ended() from None
        return self._seen(delta)

    def receive_nowait(self) -> Delta:
        """The next delta if the engine already produced it (else ``trio.WouldBlock``)."""
        assert self.channel is not None
        if self.finished:
            raise trio.EndOfChannel
        try:
            delta = self.channel.receive_nowait()
        except trio.EndOfChannel:
            raise self._ended() from None
        return self._seen(delta)

    def _seen(self, delta: Delta) -> Delta:
        if delta.finish_reason is not None:
            self.finished = True
        return delta

    def _ended(self) -> Exception:
        """What a stream that ended without its finish reason raises: the engine's error."""
        if isinstance(self.error, EngineError):
            return self._backend._remote(self.error, self._request_id)
        return WorkerDisconnected(
            f"worker {self._backend.worker_id} ended the stream without a finish reason"
        )

    def set_sink(self, sink: Callable[[Delta], bool]) -> None:
        """The engine's task hands non-final deltas to ``sink`` (see ``DeltaStream``)."""
        assert self.channel is not None

        def take(delta: Delta) -> bool:
            return delta.finish_reason is None and sink(delta)

        self.channel.attach(take)


class InProcessBackend:
    """One engine, called directly.

    Args:
        worker_id: the worker's id in its pool.
        engine: the engine doing the work.
        stage: the stage name used in error reports.
    """

    def __init__(self, worker_id: str, engine: Engine, *, stage: str = "") -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.stage = stage or engine.role.value
        self.connected = True
        self.draining = False
        self.in_flight = 0
        self.aborts_sent = 0
        self.refused: str | None = None
        self._connected_event = trio.Event()
        self._connected_event.set()

    def __repr__(self) -> str:
        return f"<InProcessBackend {self.worker_id} connected={self.connected}>"

    def status(self) -> BackendStatus:
        return BackendStatus(
            connected=self.connected,
            draining=self.draining,
            ready=self.engine.is_ready(),
            worker_load=self.in_flight,
            aborts_sent=self.aborts_sent,
            worker_aborts=self.aborts_sent,
            refused=self.refused,
            refusals=int(self.refused is not None),
            adapters=announced_adapters(self.engine.capabilities),
        )

    def expect(self, requirement: WorkerRequirement) -> None:
        """Refuse the engine if its role or model does not fit ``requirement``."""
        engine = self.engine
        self.refused = requirement.problem(role=engine.role.value, models=(engine.model,))
        if self.refused is not None:
            logger.error("refusing in-process worker %s: %s", self.worker_id, self.refused)

    def disconnect(self) -> None:
        """Make the worker unreachable (new calls fail with WorkerDisconnected)."""
        self.connected = False
        self._connected_event = trio.Event()

    def _crashed(self) -> None:
        logger.warning("in-process worker %s crashed", self.worker_id)
        self.disconnect()

    def reconnect(self) -> None:
        self.connected = True
        self._connected_event.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Nothing to maintain; reports started and waits to be cancelled."""
        task_status.started()
        await trio.sleep_forever()

    async def wait_connected(self) -> None:
        await self._connected_event.wait()

    async def wait_ready(self) -> None:
        """Connected is ready: the engine is called directly."""
        await self._connected_event.wait()

    def _check_connected(self) -> None:
        if not self.connected:
            raise WorkerDisconnected(f"worker {self.worker_id} is not connected")

    def _remote(self, exc: EngineError, request_id: str) -> RemoteWorkerError:
        return RemoteWorkerError(
            exc.code,
            exc.detail,
            retryable=exc.retryable,
            worker_id=self.worker_id,
            stage=self.stage,
            request_id=request_id,
            param=exc.param,
        )

    async def _abort(self, request_id: str) -> None:
        self.aborts_sent += 1
        with trio.move_on_after(CLEANUP_TIMEOUT_S, shield=True):
            await self.engine.abort(request_id)

    async def run_stage(self, request: EncodeRequest | PrefillRequest) -> StageResult:
        """Run encode or prefill on the engine (see ``StageBackend.run_stage``)."""
        self._check_connected()
        self.in_flight += 1
        finished = False
        try:
            check_options(request, self.engine)
            if isinstance(request, EncodeRequest):
                result = await self.engine.encode(request)
            else:
                result = await self.engine.prefill(request)
            finished = True
            return result
        except EngineError as exc:
            finished = True
            raise self._remote(exc, request.request_id) from None
        except EngineCrashed:
            self._crashed()
            raise WorkerDisconnected(f"worker {self.worker_id} crashed") from None
        finally:
            self.in_flight -= 1
            if not finished:
                await self._abort(request.request_id)

    @asynccontextmanager
    async def open_stream(self, request: GenerateRequest) -> AsyncIterator[_EngineStream]:
        """Run generate on the engine in a task; yield its delta stream."""
        self._check_connected()
        stream = _EngineStream(self, request.request_id)
        send, receive = open_handoff[Delta](WORKER_DELTA_BUFFER)
        stream.channel = receive
        self.in_flight += 1
        try:
            with single_exception():
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._generate, request, send, stream)
                    try:
                        with receive:
                            yield stream
                    finally:
                        nursery.cancel_scope.cancel(reason="stream closed")
        finally:
            self.in_flight -= 1
            if not stream.finished:
                await self._abort(request.request_id)

    async def _generate(
        self,
        request: GenerateRequest,
        send: HandoffSender[Delta],
        stream: _EngineStream,
    ) -> None:
        async with send:
            try:
                check_options(request, self.engine)
                await self.engine.generate(request, send.send)
            except EngineError as exc:
                stream.error = exc
            except EngineCrashed:
                self._crashed()
            except trio.BrokenResourceError:
                logger.debug("stream %s closed by its reader", request.request_id)

    async def release(self, kv_transfer_params: dict[str, object]) -> bool:
        self._check_connected()
        try:
            return await self.engine.release(kv_transfer_params)
        except EngineError as exc:
            raise self._remote(exc, "release") from None
