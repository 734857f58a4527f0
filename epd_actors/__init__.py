"""epd_actors: a Trio-native router for Encode/Prefill/Decode disaggregated LLM serving.

The embeddable API::

    async with epd_actors.open_router(config) as router:
        async with router.generate(request) as events:
            async for event in events:
                ...
"""

from .core.config import ActorLimits, Deadlines, PoolConfig, RouterConfig, WorkerEndpoint
from .core.router import Router, open_router
from .errors import (
    ConfigError,
    EpdError,
    InvalidRequest,
    NoHealthyWorker,
    Overloaded,
    RemoteWorkerError,
    RequestCancelled,
    StageTimeout,
    WorkerError,
)
from .protocol import ChatMessage, MediaItem, Prompt, SamplingParams, Usage
from .request import (
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    GenerationEvent,
    GenerationRequest,
    RequestTimings,
    UsageEvent,
)

__version__ = "0.1.0"

__all__ = [
    "ActorLimits",
    "ChatMessage",
    "ConfigError",
    "Deadlines",
    "DeltaEvent",
    "DoneEvent",
    "EpdError",
    "ErrorEvent",
    "GenerationEvent",
    "GenerationRequest",
    "InvalidRequest",
    "MediaItem",
    "NoHealthyWorker",
    "Overloaded",
    "PoolConfig",
    "Prompt",
    "RemoteWorkerError",
    "RequestCancelled",
    "RequestTimings",
    "Router",
    "RouterConfig",
    "SamplingParams",
    "StageTimeout",
    "Usage",
    "UsageEvent",
    "WorkerEndpoint",
    "WorkerError",
    "open_router",
]
