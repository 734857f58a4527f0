"""Record ``golden.json``: each case answered by a plain single vLLM instance.

    python tests/real_vllm/record_golden.py [LANE_DIR]      (default: .real-vllm)

Starts one plain ``vllm serve`` per tiny model (no connectors, no router), asks
every golden case of ``cases.py`` once (the others are compared with a plain
instance by the lane itself), writes the answers to ``golden.json`` and
stops the instances.  Run it after changing a case or the model builders.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.real_vllm.cases import CASES, GOLDEN_PATH, answer_of
from tests.real_vllm.fleet import Lane, Process, start_plain, wait_until_ready


def main() -> int:
    lane = Lane(Path(sys.argv[1] if len(sys.argv) > 1 else ".real-vllm").resolve())
    servers: dict[str, tuple[Process, str]] = {}
    for kind in ("qwen2vl", "llama"):
        servers[kind] = start_plain(lane, kind)
    try:
        wait_until_ready([(p, f"{url}/health") for p, url in servers.values()], timeout_s=600)
        golden = {}
        for case in (case for case in CASES.values() if case.golden):
            _, url = servers[case.model_kind]
            body = case.body(str(lane.model(case.model_kind)))
            response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
            response.raise_for_status()
            golden[case.name] = answer_of(response.json()).to_json()
            print(case.name, golden[case.name])
    finally:
        for process, _ in servers.values():
            process.stop()
    GOLDEN_PATH.write_text(json.dumps(golden, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {GOLDEN_PATH}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
