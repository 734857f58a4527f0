#!/usr/bin/env bash
# 1E1P1D with stock `vllm serve` on one GPU host, then the router in front of them.
#
#   MODEL=Qwen/Qwen2.5-VL-3B-Instruct bash examples/vllm/serve_1e1p1d.sh
#
# GPUs: E on $E_GPU, P on $P_GPU, D on $D_GPU (default 0, 1, 2). E writes encoder outputs to
# $EC_DIR (shared storage; ECExampleConnector), P hands its KV to D over NIXL. The router
# reads examples/vllm/epd_1e1p1d.toml (ports 8100-8102) and serves on 127.0.0.1:8000.
# Ctrl-C stops the router and the three servers.
set -euo pipefail
MODEL=${MODEL:?set MODEL to a multimodal model, e.g. Qwen/Qwen2.5-VL-3B-Instruct}
NAME=epd-model   # the "model" of the router config next to this script
E_GPU=${E_GPU:-0}; P_GPU=${P_GPU:-1}; D_GPU=${D_GPU:-2}
EC_DIR=${EC_DIR:-$(mktemp -d -t epd-ec-XXXX)}
HERE=$(cd "$(dirname "$0")" && pwd)

COMMON=(--served-model-name "$NAME" --host 127.0.0.1 --enable-request-id-headers)
EC_PRODUCER="{\"ec_connector\":\"ECExampleConnector\",\"ec_role\":\"ec_producer\",\"ec_connector_extra_config\":{\"shared_storage_path\":\"$EC_DIR\"}}"
EC_CONSUMER="{\"ec_connector\":\"ECExampleConnector\",\"ec_role\":\"ec_consumer\",\"ec_connector_extra_config\":{\"shared_storage_path\":\"$EC_DIR\"}}"
KV_PRODUCER='{"kv_connector":"NixlConnector","kv_role":"kv_producer"}'
KV_CONSUMER='{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}'

pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

CUDA_VISIBLE_DEVICES=$E_GPU vllm serve "$MODEL" "${COMMON[@]}" --port 8100 \
    --mm-encoder-only --no-enable-prefix-caching --ec-transfer-config "$EC_PRODUCER" &
pids+=($!)
CUDA_VISIBLE_DEVICES=$P_GPU VLLM_NIXL_SIDE_CHANNEL_PORT=5600 vllm serve "$MODEL" "${COMMON[@]}" \
    --port 8101 --ec-transfer-config "$EC_CONSUMER" --kv-transfer-config "$KV_PRODUCER" &
pids+=($!)
CUDA_VISIBLE_DEVICES=$D_GPU VLLM_NIXL_SIDE_CHANNEL_PORT=5601 vllm serve "$MODEL" "${COMMON[@]}" \
    --port 8102 --kv-transfer-config "$KV_CONSUMER" &
pids+=($!)

for port in 8100 8101 8102; do
    until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do sleep 2; done
done
echo "E, P and D are up; starting the router"
python -m epd_actors serve --config "$HERE/epd_1e1p1d.toml"
