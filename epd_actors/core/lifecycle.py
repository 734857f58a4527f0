"""The request lifecycle: one state table, one place.

Theory of operation: every request the router accepts moves through

    received -> planned -> (encoding | prefilling | decoding)* -> done | failed | cancelled

A stage actor class names the phase its stage runs in (``BaseActor.phase``);
the supervisor moves the request into that phase before the stage starts.
Stage phases may follow each other in any order the plan chose (a PD-only
request goes straight from planned to decoding), only a stage phase may end
in ``done``, nothing leaves a final state and nothing skips planning.  An
illegal transition is a bug in the router and raises ``LocalProtocolError``.
"""

from __future__ import annotations

import enum

from ..errors import LocalProtocolError


class Phase(enum.StrEnum):
    """Where a request is."""

    RECEIVED = "received"
    PLANNED = "planned"
    ENCODING = "encoding"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


STAGE_PHASES = frozenset({Phase.ENCODING, Phase.PREFILLING, Phase.DECODING})
FINAL_PHASES = frozenset({Phase.DONE, Phase.FAILED, Phase.CANCELLED})
_ENDINGS = frozenset({Phase.FAILED, Phase.CANCELLED})

TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.RECEIVED: frozenset({Phase.PLANNED}) | _ENDINGS,
    Phase.PLANNED: STAGE_PHASES | _ENDINGS,
    Phase.ENCODING: STAGE_PHASES | FINAL_PHASES,
    Phase.PREFILLING: STAGE_PHASES | FINAL_PHASES,
    Phase.DECODING: STAGE_PHASES | FINAL_PHASES,
    Phase.DONE: frozenset(),
    Phase.FAILED: frozenset(),
    Phase.CANCELLED: frozenset(),
}


class Lifecycle:
    """The phase of one request, with the history of how it got there."""

    __slots__ = ("history", "phase")

    def __init__(self) -> None:
        self.phase = Phase.RECEIVED
        self.history: list[Phase] = [Phase.RECEIVED]

    def __repr__(self) -> str:
        return f"<Lifecycle {self.phase.value}>"

    @property
    def finished(self) -> bool:
        return self.phase in FINAL_PHASES

    def advance(self, phase: Phase) -> None:
        """Move to ``phase``; re-entering the current stage phase is a no-op.

        Raises:
            LocalProtocolError: the table does not allow the transition.
        """
        if phase == self.phase and phase in STAGE_PHASES:
            return
        if phase not in TRANSITIONS[self.phase]:
            raise LocalProtocolError(
                f"illegal request transition {self.phase.value} -> {phase.value}"
            )
        self.phase = phase
        self.history.append(phase)
