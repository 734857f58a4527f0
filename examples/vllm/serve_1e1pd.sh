#!/usr/bin/env bash
# 1E1PD with stock `vllm serve` on one GPU host, then the router in front of them.
#
#   MODEL=Qwen/Qwen2.5-VL-3B-Instruct bash examples/vllm/serve_1e1pd.sh
#
# E on $E_GPU (default 0) writes encoder outputs to $EC_DIR (ECExampleConnector); the merged
# PD server on $PD_GPU (default 1) reads them and generates. The router reads
# examples/vllm/epd_1e1pd.toml (ports 8100 and 8103) and serves on 127.0.0.1:8000.
set -euo pipefail
MODEL=${MODEL:?set MODEL to a multimodal model, e.g. Qwen/Qwen2.5-VL-3B-Instruct}
NAME=epd-model   # the "model" of the router config next to this script
E_GPU=${E_GPU:-0}; PD_GPU=${PD_GPU:-1}
EC_DIR=${EC_DIR:-$(mktemp -d -t epd-ec-XXXX)}
HERE=$(cd "$(dirname "$0")" && pwd)

COMMON=(--served-model-name "$NAME" --host 127.0.0.1 --enable-request-id-headers)
EC_PRODUCER="{\"ec_connector\":\"ECExampleConnector\",\"ec_role\":\"ec_producer\",\"ec_connector_extra_config\":{\"shared_storage_path\":\"$EC_DIR\"}}"
EC_CONSUMER="{\"ec_connector\":\"ECExampleConnector\",\"ec_role\":\"ec_consumer\",\"ec_connector_extra_config\":{\"shared_storage_path\":\"$EC_DIR\"}}"

pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

CUDA_VISIBLE_DEVICES=$E_GPU vllm serve "$MODEL" "${COMMON[@]}" --port 8100 \
    --mm-encoder-only --no-enable-prefix-caching --ec-transfer-config "$EC_PRODUCER" &
pids+=($!)
CUDA_VISIBLE_DEVICES=$PD_GPU vllm serve "$MODEL" "${COMMON[@]}" --port 8103 \
    --ec-transfer-config "$EC_CONSUMER" &
pids+=($!)

for port in 8100 8103; do
    until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do sleep 2; done
done
echo "E and PD are up; starting the router"
python -m epd_actors serve --config "$HERE/epd_1e1pd.toml"
