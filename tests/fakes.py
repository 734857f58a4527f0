"""Test doubles that speak the real interfaces (no mocks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pytest
import trio

from epd_actors.errors import EngineCrashed, EngineError
from epd_actors.protocol import (
    Delta,
    EncodeRequest,
    ErrorCode,
    GenerateRequest,
    PrefillRequest,
    Role,
    StageResult,
    Usage,
)

if TYPE_CHECKING:
    from epd_actors.worker.engine import DeltaSink


@dataclass
class ScriptedEngine:
    """An engine whose behaviour tests set per request through plain attributes.

    ``gate``: when set, every stage waits for it before doing anything.
    ``tokens``: how many tokens ``generate`` emits, one delta each.
    ``token_delay``: seconds between tokens.
    ``fail_with``: an exception raised at the start of every stage.
    """

    role: Role = Role.DECODE
    model: str = "fake-model"
    capabilities: tuple[str, ...] = ()
    tokens: int = 3
    token_delay: float = 0.0
    gate: trio.Event | None = None
    fail_with: BaseException | None = None
    fail_after_tokens: BaseException | None = None
    aborted: list[str] = field(default_factory=list)
    released: list[dict[str, object]] = field(default_factory=list)
    started: list[str] = field(default_factory=list)
    ready: bool = True

    async def _begin(self, request_id: str) -> None:
        self.started.append(request_id)
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_with is not None:
            raise self.fail_with

    async def encode(self, request: EncodeRequest) -> StageResult:
        await self._begin(request.request_id)
        hashes = {m.content_hash: {"by": "fake"} for m in request.media}
        return StageResult(request.request_id, ec_transfer_params=dict(hashes))

    async def prefill(self, request: PrefillRequest) -> StageResult:
        await self._begin(request.request_id)
        return StageResult(
            request.request_id, kv_transfer_params={"handle": request.request_id}, prompt_tokens=5
        )

    async def generate(self, request: GenerateRequest, emit: DeltaSink) -> None:
        await self._begin(request.request_id)
        for i in range(self.tokens):
            if self.token_delay:
                await trio.sleep(self.token_delay)
            if self.fail_after_tokens is not None and i == 1:
                raise self.fail_after_tokens
            await emit(Delta(request.request_id, token_ids=(i,), text=f"t{i} "))
        await emit(
            Delta(
                request.request_id,
                finish_reason="length",
                usage=Usage(prompt_tokens=5, completion_tokens=self.tokens),
            )
        )

    async def release(self, kv_transfer_params: dict[str, object]) -> bool:
        await trio.lowlevel.checkpoint()
        self.released.append(kv_transfer_params)
        return kv_transfer_params.get("handle") is not None

    async def abort(self, request_id: str) -> None:
        await trio.lowlevel.checkpoint()
        self.aborted.append(request_id)

    def is_ready(self) -> bool:
        return self.ready


def engine_error(code: str = ErrorCode.ENGINE_ERROR, *, retryable: bool = True) -> EngineError:
    return EngineError(code, "scripted failure", retryable=retryable)


def engine_crash() -> EngineCrashed:
    return EngineCrashed("scripted crash")


ENGINE_FAILURES = [
    pytest.param(
        engine_error(ErrorCode.MISSING_ENCODER_CACHE, retryable=False),
        "missing_encoder_cache",
        False,
        id="typed-engine-error",
    ),
    pytest.param(engine_error(), "engine_error", True, id="retryable-engine-error"),
    pytest.param(RuntimeError("boom"), "internal", True, id="unexpected-exception"),
]
"""(what the engine raises, the wire code, retryable) -- for runtime and backend tests."""
