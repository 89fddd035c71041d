#!/usr/bin/env bash
# Device check of the Triton kernels, meant for one short GPU session (~4-6 min on an H200):
#   1. the kernel tests compiled on the GPU (bf16 added, the > 2**31-offset test enabled), in seven
#      parallel pytest processes: almost all of their time is Triton compilation, which is
#      single-threaded per process, so spreading it over the CPU cores divides the wall time;
#   2. bench/triton_kernels.py (ratios against copy bandwidth and matmul throughput; ~1-2 min).
# Logs go to $OUT/kernels_check (or /tmp/kernels_check) and the summary to stdout.
#   bash bench/gpu_check_kernels.sh [tests|bench|all]
set -u
cd "$(dirname "$0")/.."
what=${1:-all}
PY=${PY:-python}
LOGS=${OUT:-/tmp}/kernels_check
mkdir -p "$LOGS"
unset TRITON_INTERPRET
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"

if [ "$what" != bench ]; then
  if ! $PY -c "import pytest" 2>/dev/null; then
    echo "pytest is not installed here: skipping the tests (bench/triton_kernels.py still checks a few cases)"
  else
    start=$(date +%s)
    run() {
      local name=$1; shift
      timeout 420 $PY -m pytest -q -p no:cacheprovider "$@" >"$LOGS/$name.log" 2>&1
      echo "$name: rc=$? $(tail -n 1 "$LOGS/$name.log")"
    }
    A=tests/kernels/test_kernels_attention.py
    run store tests/kernels/test_kernels_store_kv.py tests/kernels/test_kernels_spec_accept.py &
    run sample tests/kernels/test_kernels_sample.py &
    run shared_prefix tests/kernels/test_kernels_shared_prefix.py &
    run attn_prefill $A -k "prefill or extend" &
    run attn_decode $A -k "decode" &
    run attn_rest $A -k "not prefill and not extend and not decode" &
    run rest tests/kernels/test_kernels_{edges,lora,window}.py \
      tests/kernels/test_{row_invariant,triton_refusals}.py &
    wait
    echo "tests: $(( $(date +%s) - start )) s wall"
    grep -h -E "^(FAILED|ERROR)|Error" "$LOGS"/*.log | head -40
  fi
fi

if [ "$what" != tests ]; then
  timeout 300 $PY bench/triton_kernels.py 2>&1 | tee "$LOGS/bench.log"
  echo "bench: rc=${PIPESTATUS[0]}"
fi
