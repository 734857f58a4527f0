"""Stage actors: one class per stage, all built on ``BaseActor``.

Importing this package registers the built-in stages (encode, prefill, decode, pd).
"""

from . import decode, encode, pd, prefill
from .base import ActorStatistics, BaseActor
from .jobs import Job, StageContext, StageEvent, StageFailure, StageOutput
from .registry import STAGE_ACTORS, actor_class, register_stage, stage_policy

__all__ = [
    "STAGE_ACTORS",
    "ActorStatistics",
    "BaseActor",
    "Job",
    "StageContext",
    "StageEvent",
    "StageFailure",
    "StageOutput",
    "actor_class",
    "decode",
    "encode",
    "pd",
    "prefill",
    "register_stage",
    "stage_policy",
]
