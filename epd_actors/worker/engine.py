"""The contract between the worker runtime and an engine (simulator or vLLM).

The runtime owns sockets, framing, multiplexing, heartbeats and drain; an engine
only does the work of one stage request at a time (many concurrently).  Keep
this contract small: the vLLM adapter and the simulator both implement it, and
the runtime's tests drive it with fakes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

from ..errors import EngineError
from ..lora import announced_adapters
from ..protocol import (
    Delta,
    EncodeRequest,
    ErrorCode,
    GenerateRequest,
    PrefillRequest,
    Role,
    StageRequest,
    StageResult,
)

DeltaSink = Callable[[Delta], Awaitable[None]]
"""Where ``Engine.generate`` sends its output.

Backpressure: awaiting the sink blocks while the request's outgoing buffer is
full; an engine must not buffer output of its own without bound.
"""


class Engine(Protocol):
    """What the worker runtime needs from an engine.

    Errors: a method that cannot do its work raises ``errors.EngineError`` with a
    wire error code; anything else is reported as ``internal`` and logged.

    Cancellation: every coroutine may be cancelled at any await (the runtime
    cancels a request when its client sends ``Abort`` or disconnects, and at the
    end of a drain).  After cancelling, the runtime calls :meth:`abort` for the
    request id, so the engine can free whatever the request still held.
    """

    role: Role
    model: str
    capabilities: tuple[str, ...]
    supported_options: frozenset[str]
    """The request ``options`` this engine honours; :func:`check_options` refuses others."""

    async def encode(self, request: EncodeRequest) -> StageResult:
        """Encode every media item into the encoder cache (role ``encode``)."""
        ...

    async def prefill(self, request: PrefillRequest) -> StageResult:
        """Prefill the prompt; the result carries ``kv_transfer_params`` (role ``prefill``)."""
        ...

    async def generate(self, request: GenerateRequest, emit: DeltaSink) -> None:
        """Stream output through ``emit``; the last delta has ``finish_reason`` set.

        Used by roles ``decode`` (with P's ``kv_transfer_params``) and ``pd``.
        """
        ...

    async def release(self, kv_transfer_params: dict[str, object]) -> bool:
        """Free a prefilled KV handle nobody will consume; False if it was already gone."""
        ...

    async def abort(self, request_id: str) -> None:
        """Forget everything held for ``request_id``; idempotent, unknown ids are fine."""
        ...

    def is_ready(self) -> bool:
        """True when the engine can take work (not merely when the process is up)."""
        ...


def check_options(request: StageRequest, engine: Engine) -> None:
    """Refuse a request carrying an option, or a LoRA adapter, the engine cannot honour.

    An option an engine does not apply would change the answer without
    anybody seeing it, so the request fails instead, naming the field.

    Raises:
        EngineError: ``invalid_request``, with ``param`` naming the first such option.
    """
    if not isinstance(request, EncodeRequest):
        check_adapter(request.lora_adapter, engine)
    if request.options:
        check_option_names(request.options, engine)


def check_adapter(adapter: str | None, engine: Engine) -> None:
    """Refuse a LoRA adapter the engine does not announce (``lora:NAME`` capabilities).

    Raises:
        EngineError: ``invalid_request`` blaming ``model``.
    """
    if adapter is None or adapter in announced_adapters(engine.capabilities):
        return
    raise EngineError(
        ErrorCode.INVALID_REQUEST,
        f"this worker (model {engine.model}) does not serve the LoRA adapter {adapter!r}",
        param="model",
    )


def check_option_names(names: Iterable[str], engine: Engine) -> None:
    """:func:`check_options` for option names (a server that has no stage request yet).

    Raises:
        EngineError: ``invalid_request``, with ``param`` naming the first unsupported one.
    """
    for name in names:
        if name not in engine.supported_options:
            raise EngineError(
                ErrorCode.INVALID_REQUEST,
                f"{name} is not supported by this worker's {'/'.join(engine.capabilities)} "
                f"engine (model {engine.model})",
                param=name,
            )
