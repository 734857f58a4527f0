"""The ``[tracing]`` settings (no OpenTelemetry import: tracing is off by default)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

EXPORTERS: Final = ("otlp", "console")
"""The span exporters ``[tracing] exporter`` may name (see :mod:`.otel`)."""


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """Where and how much the router traces.

    Attributes:
        enabled: trace requests at all (off: no OpenTelemetry import, no cost).
        endpoint: the OTLP/HTTP traces endpoint, e.g.
            ``http://collector:4318/v1/traces``; empty: the exporter's own
            default (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, else localhost).
        service_name: the ``service.name`` resource attribute of every span.
        sample_ratio: the share of new traces recorded (0 to 1); a request
            whose client sent a ``traceparent`` follows the client's decision.
        exporter: ``otlp`` (batched, to ``endpoint``) or ``console`` (stdout).
    """

    enabled: bool = False
    endpoint: str = ""
    service_name: str = "epd-actors"
    sample_ratio: float = 1.0
    exporter: str = "otlp"

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"sample_ratio must be between 0 and 1, got {self.sample_ratio}")
        if self.exporter not in EXPORTERS:
            raise ValueError(
                f"exporter must be one of {', '.join(EXPORTERS)}, got {self.exporter!r}"
            )
        if not self.service_name:
            raise ValueError("service_name must not be empty")
