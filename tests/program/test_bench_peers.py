"""The benchmark harness's peer routers: vLLM's example EPD proxy's command line and start-up.

The proxy itself (``disagg_epd_proxy.py``) lives in a vLLM checkout, not here,
so the start-up tests run a stand-in program that takes the proxy's
command line (its argparse options, all three URL lists required) and answers
``GET /health`` as it does.
"""

from __future__ import annotations

import json
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    from harness import (
        HTTP_KINDS,
        PEER_COMMANDS,
        PeerPrograms,
        Scenario,
        epd_proxy_argv,
        start_scenario,
    )
    from run_router_overhead import parse_args, scenarios
finally:
    # run_router_overhead puts the directory on the path again itself.
    sys.path[:] = [entry for entry in sys.path if entry != str(ROOT / "benchmarks")]

ENDPOINTS = [
    ("encode", "encode-0", "http://127.0.0.1:1"),
    ("prefill", "prefill-1", "http://127.0.0.1:2"),
    ("prefill", "prefill-2", "http://127.0.0.1:3"),
    ("decode", "decode-3", "http://127.0.0.1:4"),
]

# The proxy's command line and /health, and nothing else; it writes what it was given to argv.json.
STAND_IN = """
import argparse, http.server, json, pathlib
parser = argparse.ArgumentParser()
parser.add_argument("--host", default="0.0.0.0")
parser.add_argument("--port", type=int, default=8000)
parser.add_argument("--encode-servers-urls", required=True)
parser.add_argument("--prefill-servers-urls", required=True)
parser.add_argument("--decode-servers-urls", required=True)
args = parser.parse_args()
pathlib.Path(__file__).with_name("argv.json").write_text(json.dumps(vars(args)))

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("content-length", "0")
        self.end_headers()

http.server.HTTPServer((args.host, args.port), Health).serve_forever()
"""


def test_the_epd_proxy_gets_each_role_as_a_comma_separated_list() -> None:
    argv = epd_proxy_argv("/venv/bin/python", "/vllm/disagg_epd_proxy.py", 9000, ENDPOINTS)
    assert argv[:2] == ["/venv/bin/python", "/vllm/disagg_epd_proxy.py"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--port") + 1] == "9000"
    assert argv[argv.index("--encode-servers-urls") + 1] == "http://127.0.0.1:1"
    assert argv[argv.index("--prefill-servers-urls") + 1] == "http://127.0.0.1:2,http://127.0.0.1:3"
    assert argv[argv.index("--decode-servers-urls") + 1] == "http://127.0.0.1:4"


def test_without_e_the_encode_list_is_empty_and_without_p_prefill_is_disabled() -> None:
    pd_only = [e for e in ENDPOINTS if e[0] != "encode"]
    argv = epd_proxy_argv("python", "proxy.py", 9000, pd_only)
    assert argv[argv.index("--encode-servers-urls") + 1] == ""
    e_pd = [e for e in ENDPOINTS if e[0] != "prefill"]
    argv = epd_proxy_argv("python", "proxy.py", 9000, e_pd)
    assert argv[argv.index("--prefill-servers-urls") + 1] == "disable"


def test_each_peer_kind_names_the_option_it_is_missing() -> None:
    with pytest.raises(RuntimeError, match="--epd-proxy PATH"):
        PEER_COMMANDS["epd-proxy"](PeerPrograms(vllm_router="vllm-router"), 9000, ENDPOINTS)
    with pytest.raises(RuntimeError, match="--vllm-router PATH"):
        PEER_COMMANDS["vllm-router-pd"](PeerPrograms(epd_proxy="proxy.py"), 9000, ENDPOINTS)
    programs = PeerPrograms(vllm_router="vllm-router", epd_proxy="proxy.py", epd_proxy_python="py")
    assert PEER_COMMANDS["epd-proxy"](programs, 9000, ENDPOINTS)[:2] == ["py", "proxy.py"]
    assert "--vllm-pd-disaggregation" in PEER_COMMANDS["vllm-router-pd"](programs, 9000, ENDPOINTS)
    assert "--vllm-pd-disaggregation" not in PEER_COMMANDS["vllm-router"](programs, 9000, ENDPOINTS)


def test_the_epd_proxy_scenarios_mirror_http_pd_and_http_epd() -> None:
    known = scenarios()
    for name, twin in (("epd-proxy-pd", "http-pd"), ("epd-proxy-epd", "http-epd")):
        assert known[name].kind == "epd-proxy"
        assert [role for role, _ in known[name].workers] == [r for r, _ in known[twin].workers]
    assert "epd-proxy" in HTTP_KINDS  # HTTP workers, and D's request log is checked
    args = parse_args(["--epd-proxy", "proxy.py"])
    assert (args.epd_proxy, args.epd_proxy_python) == ("proxy.py", sys.executable)


@pytest.mark.processes
def test_an_epd_proxy_scenario_starts_the_script_and_waits_for_its_health(tmp_path: Path) -> None:
    script = tmp_path / "disagg_epd_proxy.py"
    script.write_text(STAND_IN, encoding="utf-8")
    scenario = Scenario("epd-proxy-none", "the stand-in over no workers", [], "epd-proxy")
    with ExitStack() as stack:
        start_scenario(
            scenario, stack, tmp_path, epd_proxy=str(script), epd_proxy_python=sys.executable
        )
        assert scenario.router is not None
        assert scenario.router.popen.poll() is None
        given = json.loads((tmp_path / "argv.json").read_text())
        assert scenario.url == f"http://127.0.0.1:{given['port']}"
        assert given["host"] == "127.0.0.1"
        assert given["prefill_servers_urls"] == "disable"
        router = scenario.router
    assert router.popen.returncode is not None  # stopped with the stack


@pytest.mark.processes
def test_an_epd_proxy_that_exits_fails_the_scenario(tmp_path: Path) -> None:
    script = tmp_path / "disagg_epd_proxy.py"
    script.write_text("raise SystemExit(2)\n", encoding="utf-8")
    scenario = Scenario("epd-proxy-broken", "a proxy that exits", [], "epd-proxy")
    with ExitStack() as stack, pytest.raises(RuntimeError, match="did not become healthy"):
        start_scenario(scenario, stack, tmp_path, epd_proxy=str(script))
    assert scenario.router is None
