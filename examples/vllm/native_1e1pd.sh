#!/usr/bin/env bash
# 1E1PD with native workers that embed vLLM, then the router in front of them.
#
#   MODEL=Qwen/Qwen2.5-VL-3B-Instruct bash examples/vllm/native_1e1pd.sh
#
# E on $E_GPU (default 0) writes encoder outputs to $EC_DIR; the merged PD worker on $PD_GPU
# (default 1) reads them. Extra engine arguments go in $ENGINE_ARGS. The router reads
# examples/vllm/native_1e1pd.toml (workers on ports 9100 and 9103).
set -euo pipefail
MODEL=${MODEL:?set MODEL to a multimodal model, e.g. Qwen/Qwen2.5-VL-3B-Instruct}
E_GPU=${E_GPU:-0}; PD_GPU=${PD_GPU:-1}
EC_DIR=${EC_DIR:-$(mktemp -d -t epd-ec-XXXX)}
read -r -a ENGINE <<< "${ENGINE_ARGS:-}"
HERE=$(cd "$(dirname "$0")" && pwd)
export EPD_AUTH_TOKEN=${EPD_AUTH_TOKEN:-$(python -c 'import secrets; print(secrets.token_urlsafe(24))')}
EC_EXTRA="{\"shared_storage_path\": \"$EC_DIR\"}"

pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

CUDA_VISIBLE_DEVICES=$E_GPU python -m epd_actors worker --engine vllm --model "$MODEL" \
    --role encode --worker-id encode-0 --listen tcp://127.0.0.1:9100 \
    --ec-connector ECExampleConnector --ec-connector-extra "$EC_EXTRA" -- "${ENGINE[@]}" &
pids+=($!)
CUDA_VISIBLE_DEVICES=$PD_GPU python -m epd_actors worker --engine vllm --model "$MODEL" \
    --role pd --worker-id pd-0 --listen tcp://127.0.0.1:9103 \
    --ec-connector ECExampleConnector --ec-connector-extra "$EC_EXTRA" -- "${ENGINE[@]}" &
pids+=($!)

for port in 9100 9103; do
    until (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do sleep 2; done
done
echo "E and PD engines are ready; starting the router"
python -m epd_actors serve --config "$HERE/native_1e1pd.toml"
