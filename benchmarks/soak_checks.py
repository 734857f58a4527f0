"""What the soak test checks on every request, and how it adds the results up.

Pure and synchronous: :class:`StreamCheck` reads one streamed chat completion,
event by event, against the text the simulator produces for the same request
(a pure function of the prompt, ``temperature: 0``), and says what the client
got (``ok`` or an error code) and which invariants the stream broke:

- exactly one terminal event: ``data: [DONE]`` or an ``error`` event, and
  nothing after it (in particular never ``[DONE]`` after an error);
- the text is always a prefix of the simulator's text (a retry that repeated
  output, or a stream stitched from two attempts, diverges), and a completed
  stream is all of it;
- an answer that is not a stream is an OpenAI error body.

:class:`Tally` counts outcomes, faults and violations, and samples of the
router's memory and descriptors, for the summary ``benchmarks/soak.py``
prints.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

DONE = "[DONE]"
OK = "ok"
# Violations kept verbatim in the summary (the count covers them all).
MAX_EXAMPLES = 20


@dataclass(frozen=True, slots=True)
class SseEvent:
    """One server-sent event: its ``event:`` name (``message`` when absent) and data."""

    name: str
    data: str


class SseParser:
    """Splits a stream's lines into events (``feed`` one line at a time, without its newline)."""

    def __init__(self) -> None:
        self._name = "message"
        self._data: list[str] = []

    def feed(self, line: str) -> SseEvent | None:
        """The event a blank line completes, else None (comments are skipped)."""
        if not line:
            return self._flush()
        if line.startswith(":"):
            return None
        key, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if key == "event":
            self._name = value
        elif key == "data":
            self._data.append(value)
        return None

    def close(self) -> SseEvent | None:
        """An event left unterminated at the end of the stream, if any."""
        return self._flush()

    def _flush(self) -> SseEvent | None:
        if not self._data:
            self._name = "message"
            return None
        event = SseEvent(self._name, "\n".join(self._data))
        self._name = "message"
        self._data = []
        return event


def judge_stream(lines: Iterable[str], reference: str) -> StreamCheck:
    """Feed a stream's lines to a :class:`StreamCheck` against ``reference``, ended."""
    parser = SseParser()
    check = StreamCheck(reference)
    for line in lines:
        event = parser.feed(line)
        if event is not None:
            check.event(event)
    tail = parser.close()
    if tail is not None:
        check.event(tail)
    check.end()
    return check


def error_code(body: object) -> str | None:
    """The ``code`` (else ``type``) of an OpenAI error body, or None if it is not one."""
    if not isinstance(body, dict):
        return None
    error = body.get("error")
    if not isinstance(error, dict):
        return None
    code = error.get("code") or error.get("type")
    return code if isinstance(code, str) and code else None


class StreamCheck:
    """The invariants of one streamed chat completion.

    Args:
        reference: the simulator's full text for this request.
    """

    def __init__(self, reference: str) -> None:
        self.reference = reference
        self.text = ""
        self.terminal: str | None = None
        self.finish_reason: str | None = None
        self.violations: list[str] = []
        self._diverged = False

    def event(self, event: SseEvent) -> None:
        """Check one event of the stream."""
        if self.terminal is not None:
            self._after_terminal(event)
        elif event.name == "error":
            self._error(event.data)
        elif event.data == DONE:
            self._done()
        else:
            self._chunk(event.data)

    def end(self) -> None:
        """The stream's body ended: it must have ended with a terminal event."""
        if self.terminal is None:
            self.violations.append("the stream ended without a terminal event")

    @property
    def outcome(self) -> str:
        """``ok``, ``stream:<code>`` for an error event, or ``cut`` without a terminal event."""
        if self.terminal == DONE:
            return OK
        return "cut" if self.terminal is None else f"stream:{self.terminal}"

    def _after_terminal(self, event: SseEvent) -> None:
        if event.data == DONE and self.terminal != DONE:
            self.violations.append(f"[DONE] after an error event ({self.terminal})")
        else:
            self.violations.append(f"an event after the terminal one ({self.terminal})")

    def _error(self, data: str) -> None:
        code = error_code(_json(data))
        if code is None:
            self.violations.append(f"an error event without an OpenAI error body: {data[:120]!r}")
            code = "unreadable"
        self.terminal = code

    def _done(self) -> None:
        self.terminal = DONE
        if self.finish_reason is None:
            self.violations.append("[DONE] without a finish_reason")
        if self.text != self.reference and not self._diverged:
            self.violations.append(
                f"completed with {len(self.text)} characters of the simulator's "
                f"{len(self.reference)}"
            )

    def _chunk(self, data: str) -> None:
        chunk = _json(data)
        choice = _first_choice(chunk)
        if choice is None:
            self.violations.append(f"a data event that is not a chat chunk: {data[:120]!r}")
            return
        delta = choice.get("delta")
        content = delta.get("content") if isinstance(delta, dict) else None
        if isinstance(content, str):
            self.text += content
            if not self._diverged and not self.reference.startswith(self.text):
                self._diverged = True
                self.violations.append(
                    f"the text left the simulator's output at character "
                    f"{_divergence(self.text, self.reference)} (repeated or foreign output)"
                )
        finish = choice.get("finish_reason")
        if isinstance(finish, str):
            self.finish_reason = finish


def _json(data: str) -> object:
    try:
        return json.loads(data)
    except ValueError:
        return None


def _first_choice(chunk: object) -> dict[str, object] | None:
    if not isinstance(chunk, dict):
        return None
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return None
    if not choices:
        return {}  # the usage chunk has no choices
    first = choices[0]
    return first if isinstance(first, dict) else None


def _divergence(text: str, reference: str) -> int:
    for index, (got, want) in enumerate(zip(text, reference, strict=False)):
        if got != want:
            return index
    return min(len(text), len(reference))


def refused_outcome(status: int, body: object) -> tuple[str, list[str]]:
    """The outcome of an answer that is not a stream, and its violations."""
    code = error_code(body)
    if code is None:
        return f"{status}:unreadable", [f"HTTP {status} without an OpenAI error body"]
    problems = [] if status >= 400 else [f"HTTP {status} with an error body and no stream"]
    return f"{status}:{code}", problems


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one request ended with."""

    kind: str
    violations: tuple[str, ...] = ()
    image: bool = False


@dataclass(frozen=True, slots=True)
class ProcessSample:
    """The router process at one moment: resident memory and open descriptors."""

    at_s: float
    rss_kib: int
    fds: int


@dataclass
class Tally:
    """Everything a soak run counts."""

    outcomes: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    violations: int = 0
    examples: list[str] = field(default_factory=list)
    image_requests: int = 0
    samples: list[ProcessSample] = field(default_factory=list)

    def record(self, outcome: Outcome, label: str) -> None:
        """Count one request (``label`` names it in the examples kept)."""
        self.outcomes[outcome.kind] += 1
        self.image_requests += outcome.image
        self.violations += len(outcome.violations)
        for problem in outcome.violations:
            if len(self.examples) < MAX_EXAMPLES:
                self.examples.append(f"{label}: {problem}")

    def fault(self, kind: str) -> None:
        self.faults[kind] += 1

    def violation(self, problem: str) -> None:
        """A violation found outside any one request (at the end of the run)."""
        self.violations += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(problem)

    @property
    def requests(self) -> int:
        return sum(self.outcomes.values())

    @property
    def successes(self) -> int:
        return self.outcomes[OK]

    def figures(self, kind: str) -> dict[str, int]:
        """First, quarter-way, half-way, last and largest sample of ``rss_kib`` or ``fds``."""
        values = [getattr(sample, kind) for sample in self.samples]
        if not values:
            return {}
        quarter = len(values) // 4
        return {
            "first": values[0],
            "quarter": values[quarter],
            "half": values[len(values) // 2],
            "last": values[-1],
            "max": max(values),
        }

    def summary(self) -> dict[str, object]:
        """The run's figures as plain JSON-ready data."""
        requests = self.requests
        return {
            "requests": requests,
            "image_requests": self.image_requests,
            "successes": self.successes,
            "success_rate": round(self.successes / requests, 4) if requests else None,
            "failures": {k: v for k, v in sorted(self.outcomes.items()) if k != OK},
            "faults": dict(sorted(self.faults.items())),
            "faults_total": sum(self.faults.values()),
            "violations": self.violations,
            "violation_examples": list(self.examples),
            "router_rss_kib": self.figures("rss_kib"),
            "router_fds": self.figures("fds"),
            "samples": len(self.samples),
        }
