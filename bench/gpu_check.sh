#!/usr/bin/env bash
# One-shot check of tandem on a machine with an NVIDIA GPU and only minutes on it.
#
#   bench/gpu_check.sh [OUT_DIR]        # default: <results dir>/gpu_check/<UTC time>, the results dir
#                                       # being bench.report.results_dir()'s (outside the tree)
#
# Setup (not counted in the budget): `make install`, which installs nothing GPU-specific beyond the
# torch wheel pip picks for this machine, and `tandem fetch-model` for the served model (a failure
# there only skips the steps that need the model). On a machine that cannot reach PyPI, whose own
# Python already holds torch and Triton, two variables replace both:
#
#   TANDEM_PYTHON=python3          that interpreter as it is, no `make install` (tandem's other
#                                  requirements on its path, e.g. wheels installed with --target)
#   TANDEM_GPU_SHAPE_OF=DIR        serve random weights of the shape of DIR's config.json with DIR's
#                                  tokenizer (the checkpoint's weights need not be there); no fetch
#
# Then each step runs under its own time limit, in under 10 minutes together (limits sum to 590 s),
# and a failed step does not stop the others:
#
#   env.log               nvidia-smi, torch/triton versions, device name and compute capability
#   kernel_tests.log      tests/test_triton_kernels.py and tests/test_triton_q8_0.py compiled and run
#                         on the GPU (not interpreted)
#   parity_triton.log     greedy parity with HF on CUDA, Triton backend (tests/test_engine_parity.py,
#                         and the real model's tests/test_real_model_parity.py when it is cached)
#   parity_torch.log      the same tiny-model parity with the torch backend on CUDA
#   kernels_gpu.json/.log decode bandwidth fraction (contexts 1k-32k, batch 1-256) vs SDPA and, when
#                         installed, FlashInfer/flash-attn; prefill TFLOP/s; the static roofline;
#                         Q8_0 linears' bandwidth fraction (GEMV and GEMM) vs dequantize + matmul
#   serve.json/.log       `tandem bench serve` (64 requests) against a bf16 CUDA decode server
#                         (its log: decode-cuda.log)
#   summary.txt           one line per step: passed / failed / timed out, and its seconds
#
# Exit status: 0 when every step passed, 1 otherwise (2 when there is no usable GPU at all).
set -uo pipefail

cd "$(dirname "$0")/.."
RESULTS=${TANDEM_BENCH_RESULTS:-${TANDEM_HOME:-$HOME/.cache/tandem}/bench-results}
OUT=${1:-$RESULTS/gpu_check/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
PY=${TANDEM_PYTHON:-.venv/bin/python}
FAILED=0

if [ -n "${TANDEM_PYTHON:-}" ]; then
    echo "using $PY as it is (TANDEM_PYTHON), no make install"
else
    echo "installing (make install) -> $OUT/install.log"
    if ! make install >"$OUT/install.log" 2>&1; then
        echo "make install failed; see $OUT/install.log"
        exit 2
    fi
fi
if ! $PY -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "torch $($PY -c 'import torch; print(torch.__version__)') sees no CUDA device; this check needs one"
    exit 2
fi
# The served model: the default one when it can be fetched, else random weights of a given shape.
MODEL_READY=1
SERVE_MODEL=""
if [ -n "${TANDEM_GPU_SHAPE_OF:-}" ]; then
    MODEL_READY=0
    SERVE_MODEL=$(mktemp -d)/random-weights-model
    $PY - "$TANDEM_GPU_SHAPE_OF" "$SERVE_MODEL" >"$OUT/fetch_model.log" 2>&1 <<'EOF' || SERVE_MODEL=""
import json, sys
from pathlib import Path

from bench.near_zero_model import NearZeroModelSpec, write_near_zero_model

source, target = Path(sys.argv[1]), Path(sys.argv[2])
config = json.loads((source / "config.json").read_text())
spec = NearZeroModelSpec(
    num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
    num_heads=config["num_attention_heads"], num_kv_heads=config["num_key_value_heads"],
    intermediate_size=config["intermediate_size"],
)
print(f"random weights of {source.name}'s shape: {spec.describe()}")
write_near_zero_model(target, source, spec)
EOF
elif $PY -m tandem.cli fetch-model >"$OUT/fetch_model.log" 2>&1; then
    SERVE_MODEL=$($PY -c "from engine.model_store import resolve_model; print(resolve_model(None))")
else
    MODEL_READY=0
fi

# Kernels compile for the GPU instead of running in the interpreter; test engines run on CUDA. Tests that
# still build a CPU engine there would compile the C++ CPU kernels first (minutes): not worth the lease.
export TRITON_INTERPRET=0 TANDEM_TEST_DEVICE=cuda TANDEM_CPU_EXTENSION=0

# step NAME SECONDS COMMAND...: run COMMAND with its output in OUT/NAME.log, record the outcome.
step() {
    local name=$1 limit=$2 start=$SECONDS status rc
    shift 2
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    case $rc in
        0) status=passed ;;
        124 | 137) status="timed out after ${limit}s" ;;
        *) status="failed (exit $rc)" ;;
    esac
    [ "$rc" -eq 0 ] || FAILED=1
    printf '%-16s %-24s %4ds  %s\n' "$name" "$status" $((SECONDS - start)) "$OUT/$name.log" | tee -a "$OUT/summary.txt"
}

skip() {
    printf '%-16s %-24s %4ds  %s\n' "$1" "skipped" 0 "$2" | tee -a "$OUT/summary.txt"
}

environment() {
    nvidia-smi
    $PY - <<'EOF'
import torch, triton
props = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}")
print(f"{props.name}: sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, "
      f"{props.total_memory / 2**30:.0f} GiB")
EOF
}

serve() {
    $PY - "$OUT" "$SERVE_MODEL" <<'EOF'
import subprocess, sys
from pathlib import Path

from bench.servers import tandem_decode_server, tandem_command
out, model = Path(sys.argv[1]), sys.argv[2]
server, target = tandem_decode_server(
    "decode-cuda", model, threads=4, server_args=["--device", "cuda", "--dtype", "bfloat16"]
)
server.log_dir = out
with server:
    bench = tandem_command(
        "bench", "serve", "--target", target, "--num-prompts", "64", "--prompt-len", "uniform:60:330",
        "--output-len", "uniform:16:256", "--request-rate", "inf", "--no-progress",
        "--result-file", str(out / "serve.json"),
    )
    sys.exit(subprocess.run(bench).returncode)
EOF
}

export PY OUT SERVE_MODEL
export -f environment serve
step env 10 bash -c environment
# The benchmark's CPU dry run is a CPU test (the interpreter); the GPU run below replaces it.
step kernel_tests 180 $PY -m pytest -q -p no:cacheprovider -n 8 tests/test_triton_kernels.py \
    tests/test_triton_q8_0.py -k "not dry_run"
parity_tests=(tests/test_engine_parity.py)
[ "$MODEL_READY" -eq 1 ] && parity_tests+=(tests/test_real_model_parity.py)
step parity_triton 100 env TANDEM_ATTENTION_BACKEND=triton $PY -m pytest -q -p no:cacheprovider "${parity_tests[@]}"
step parity_torch 50 env TANDEM_ATTENTION_BACKEND=torch $PY -m pytest -q -p no:cacheprovider tests/test_engine_parity.py
step kernels_gpu 150 $PY -m bench.kernels_gpu --out "$OUT/kernels_gpu.json"
if [ -n "$SERVE_MODEL" ]; then
    step serve 100 bash -c serve
else
    skip serve "the model could not be fetched; see $OUT/fetch_model.log"
fi
echo "results in $OUT"
exit $FAILED
