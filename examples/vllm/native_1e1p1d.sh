#!/usr/bin/env bash
# 1E1P1D with native workers that embed vLLM (`python -m epd_actors worker --engine vllm`),
# then the router in front of them over the native protocol.
#
#   MODEL=Qwen/Qwen2.5-VL-3B-Instruct bash examples/vllm/native_1e1p1d.sh
#
# GPUs: E on $E_GPU, P on $P_GPU, D on $D_GPU (default 0, 1, 2). E writes encoder outputs to
# $EC_DIR (ECExampleConnector), P hands its KV to D over NIXL. Extra engine arguments for every
# worker go in $ENGINE_ARGS (on CPU: "--dtype float32 --enforce-eager --max-model-len 1024").
# The router reads examples/vllm/native_1e1p1d.toml (workers on ports 9100-9102).
set -euo pipefail
MODEL=${MODEL:?set MODEL to a multimodal model, e.g. Qwen/Qwen2.5-VL-3B-Instruct}
E_GPU=${E_GPU:-0}; P_GPU=${P_GPU:-1}; D_GPU=${D_GPU:-2}
EC_DIR=${EC_DIR:-$(mktemp -d -t epd-ec-XXXX)}
read -r -a ENGINE <<< "${ENGINE_ARGS:-}"
HERE=$(cd "$(dirname "$0")" && pwd)
export EPD_AUTH_TOKEN=${EPD_AUTH_TOKEN:-$(python -c 'import secrets; print(secrets.token_urlsafe(24))')}
export VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1

EC_EXTRA="{\"shared_storage_path\": \"$EC_DIR\"}"

pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

start() {  # start GPU ROLE PORT [options...]: one worker; waits for its "listening" line
    local gpu=$1 role=$2 port=$3; shift 3
    CUDA_VISIBLE_DEVICES=$gpu python -m epd_actors worker --engine vllm --model "$MODEL" \
        --role "$role" --worker-id "$role-0" --listen "tcp://127.0.0.1:$port" "$@" \
        -- "${ENGINE[@]}" &
    pids+=($!)
}

start "$E_GPU" encode 9100 --ec-connector ECExampleConnector --ec-connector-extra "$EC_EXTRA"
VLLM_NIXL_SIDE_CHANNEL_PORT=5600 start "$P_GPU" prefill 9101 \
    --ec-connector ECExampleConnector --ec-connector-extra "$EC_EXTRA" --kv-connector NixlConnector
VLLM_NIXL_SIDE_CHANNEL_PORT=5601 start "$D_GPU" decode 9102 --kv-connector NixlConnector

# A native worker listens only once its engine is ready.
for port in 9100 9101 9102; do
    until (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do sleep 2; done
done
echo "E, P and D engines are ready; starting the router"
python -m epd_actors serve --config "$HERE/native_1e1p1d.toml"
