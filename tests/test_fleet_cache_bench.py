"""benchmarks/fleet_cache.py runs every configuration on a tiny trace and reports each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_fleet_cache_benchmark_reports_every_configuration(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    argv = [
        sys.executable,
        str(ROOT / "benchmarks" / "fleet_cache.py"),
        *("--users", "4", "--turns", "2", "--systems", "2", "--system-words", "64"),
        *("--concurrency", "4", "--cache-blocks", "64", "--local-below", "256"),
        *("--json", str(out)),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False, env=env)
    assert done.returncode == 0, done.stderr
    results = {r["policy"]: r for r in json.loads(out.read_text())["results"]}
    assert list(results) == ["round_robin", "cache_aware", "kv_aware", "kv_aware+local"]
    for result in results.values():
        assert result["requests"] == 8
        assert 0.0 <= result["hit_rate"] <= 1.0
    assert results["round_robin"]["local_prefills"] == 0
    assert results["kv_aware+local"]["local_prefills"] > 0  # prompts under 256 tokens
    assert sum(results["kv_aware"]["decisions"].values()) == 8
