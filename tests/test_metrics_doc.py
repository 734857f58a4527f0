"""docs/metrics.md lists exactly the metric families a live router and a live worker export."""

from __future__ import annotations

import re

import pytest

from tests.metric_families import DOC, Family, documented, families, scrape_router, scrape_worker


def _compare(doc: dict[str, Family], live: dict[str, Family]) -> None:
    assert sorted(set(live) - set(doc)) == [], "exported but not in docs/metrics.md"
    assert sorted(set(doc) - set(live)) == [], "in docs/metrics.md but not exported"
    for name, family in live.items():
        assert family.type == doc[name].type, name
        if family.labels:  # a labelled family with no series yet shows no labels
            assert family.labels == doc[name].labels, name


@pytest.mark.processes
async def test_router_metrics_match_the_doc() -> None:
    live = families(await scrape_router())
    doc = {**documented("Router"), **documented("Router process")}
    _compare(doc, live)
    unlabelled = [name for name, family in live.items() if doc[name].labels and not family.labels]
    assert unlabelled == [], "every labelled family has series after a request"


@pytest.mark.processes
async def test_worker_metrics_match_the_doc() -> None:
    live = {
        name: family
        for name, family in families(await scrape_worker()).items()
        if name.startswith(("process_", "python_"))
    }
    _compare(documented("Worker"), live)


def test_router_names_follow_the_conventions() -> None:
    for name, family in documented("Router").items():
        assert re.fullmatch(r"epd_[a-z_]+", name), name
        assert (family.type == "counter") == name.endswith("_total"), name
        if "duration" in name or "latency" in name or "wait" in name or "time" in name:
            assert name.endswith("_seconds"), name


def test_the_doc_parser_reads_every_row() -> None:
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| `")]
    sections = (
        "Router",
        "Router process",
        "KV event feeds",
        "Conditional disaggregation",
        "Worker",
        "Renamed",
    )
    listed = sum(len(documented(section)) for section in sections)
    renamed = [row for row in rows if "(counter)" in row or "(gauge)" in row]
    assert listed + len(renamed) == len(rows)
