"""deploy/grafana/epd-actors.json queries only metrics a live router exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.metric_families import families, scrape_router

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "epd-actors.json"
_METRIC = re.compile(r"\b(?:epd|process|python)_[a-z_]+\b")
_HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


def expressions(node: object) -> list[str]:
    """Every ``expr`` string anywhere in the dashboard, and the variables' queries."""
    found: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                found.append(value)
            else:
                found.extend(expressions(value))
    elif isinstance(node, list):
        for item in node:
            found.extend(expressions(item))
    return found


def metric_names(expr: str) -> set[str]:
    names = set()
    for name in _METRIC.findall(expr):
        for suffix in _HISTOGRAM_SERIES:
            if name.endswith(suffix):
                name = name.removesuffix(suffix)
                break
        names.add(name)
    return names


def test_the_metric_name_extraction() -> None:
    expr = 'histogram_quantile(0.9, sum by (le) (rate(epd_ttft_seconds_bucket{job=~"$job"}[5m])))'
    assert metric_names(expr) == {"epd_ttft_seconds"}
    assert metric_names("sum(epd_a_total) / epd_b") == {"epd_a_total", "epd_b"}


def test_every_panel_has_a_query_that_names_a_metric() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert panels
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert metric_names(target["expr"]), (panel["title"], target["expr"])
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


@pytest.mark.processes
async def test_every_expression_references_an_exported_metric() -> None:
    live = families(await scrape_router())
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = expressions(dashboard)
    used = set().union(*(metric_names(expr) for expr in exprs))
    assert sorted(used - set(live)) == []
    # What the dashboard promises to show.
    for needed in (
        "epd_requests_total",
        "epd_time_to_first_token_seconds",
        "epd_inter_token_latency_seconds",
        "epd_worker_in_flight",
        "epd_worker_healthy",
        "epd_worker_breaker_state",
        "epd_retries_total",
    ):
        assert needed in used, needed
    for expr in exprs:
        histograms = [n for n in metric_names(expr) if live[n].type == "histogram"]
        for name in histograms:
            assert re.search(rf"\b{name}(_bucket|_sum|_count)\b", expr), expr
