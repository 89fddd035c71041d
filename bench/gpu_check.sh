#!/usr/bin/env bash
# The GPU session's checks, prepared to run in one device call (see docs/gpu.md).
#   bash bench/gpu_check.sh correctness   # kernel tests (bf16 too) + engine-on-CUDA tests
#   bash bench/gpu_check.sh bench         # kernel, MoE, engine-vs-transformers benchmarks
#   bash bench/gpu_check.sh more          # colocation and speculative-decoding benchmarks
#   bash bench/gpu_check.sh owed          # only what no GPU run has checked yet (~7 min):
#                                         # every Triton kernel and engine-on-CUDA test (the
#                                         # layout moved them all), partial rollouts against
#                                         # synchronous ones, engine vs transformers
#   bash bench/gpu_check.sh moe           # the fused MoE kernel: its tests compiled (bf16
#                                         # too) and bench/moe.py (~4 min)
#   bash bench/gpu_check.sh all
# Every section has its own timeout, so one failure does not eat the session. Logs go to $OUT.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=offline
# Nothing is pip-installed on that machine: the packages pyproject maps from other folders
# (rollout_kernels <- kernels, rollout_recipes <- recipes) are linked under their import names.
links=$(mktemp -d)
ln -s "$PWD/kernels" "$links/rollout_kernels"
ln -s "$PWD/recipes" "$links/rollout_recipes"
export PYTHONPATH="$PWD:$links${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
O=${OUT:-/tmp/gpu_check}
mkdir -p "$O"
what=${1:-all}
exec > >(tee -a "$O/gpu_check.log") 2>&1

section() {  # section NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@"
  echo "=== $name: rc=$? in $(( $(date +%s) - t0 ))s"
}

moe_kernel_tests() {  # in the background (wait on $!): compiled, so TRITON_INTERPRET unset
  ( env -u TRITON_INTERPRET timeout 200 $PY -m pytest -q -p no:cacheprovider \
      tests/kernels/test_kernels_fused_moe.py > "$O/moe_kernel_tests.log" 2>&1
    echo "=== fused MoE kernel tests: rc=$? $(tail -n 1 "$O/moe_kernel_tests.log")" ) &
}

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
$PY -c "import torch, triton, transformers as t; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', t.__version__)"

if [ "$what" = correctness ] || [ "$what" = all ]; then
  # Kernel tests compile ~130 variants: they run in parallel processes beside the engine tests.
  ( OUT=/tmp/kernels_logs PY=$PY timeout 300 bash bench/gpu_check_kernels.sh tests \
      > /tmp/kernel_tests.out 2>&1; cat /tmp/kernels_logs/kernels_check/*.log > "$O/kernel_tests.log" ) &
  kernel_tests=$!  # wait on it by pid: a bare `wait` would also wait for the tee above
  moe_kernel_tests
  moe_tests=$!
  section engine_tests 280 $PY -m pytest -q -p no:cacheprovider tests/project/test_gpu.py \
      tests/attention/test_triton_backend.py tests/executor/test_cuda_graph.py -rA
  section engine_cpu_suite 200 $PY -m pytest -q -p no:cacheprovider tests/models/test_parity.py \
      tests/spec/test_spec.py tests/kv/test_prefix_sharing.py
  wait "$kernel_tests" "$moe_tests"
  echo "=== kernel tests"; cat /tmp/kernel_tests.out
fi

if [ "$what" = owed ]; then
  # Every Triton kernel's tests compiled (bf16 too: the invariant attention, LoRA, fused MoE)
  # and the engine on CUDA (Triton backend and sampler with its supports, CUDA graphs, exact
  # sleep memory, carried groups, scoring, the fp32 head, unmerged LoRA), in 12 pytest-xdist
  # workers (their time is Triton compilation, a core each): all passed on 2026-12-04 (77 s),
  # rerun since they are cheap and the code moves (new since: carried_kv="park" on CUDA; ties
  # kept whole at the filters' cuts, the Triton sampler against the torch filter's supports on
  # tied rows; top-k alternatives ordered by id among ties, on CUDA tensors; the step's host
  # lists uploaded through arrays, decodes sharing one slots tensor; the batch-invariant mode
  # on CUDA: the Triton backend's row-invariant projections, norms, row sums and MoE tiles,
  # kernels/triton/row_invariant.py; the wrappers' refusals, from shapes alone when compiled,
  # tests/kernels/test_triton_refusals.py; sliding-window models on the Triton backend, graphs
  # included: tests/attention/test_windowed.py, in no mode's list before; the LoRA expand
  # kernel's rank tiles over ranks above 256, tests/lora/test_lora_kernel_ranks.py; a reported
  # row drawn from the supports it reports at top_p boundaries, and the logprobs Engine.score
  # gives, tests/sample/test_fused_draw_reports.py). Then the
  # timings, alone: what no GPU run has measured yet, partial rollouts against synchronous
  # ones, the engine against transformers on SmolLM2's shapes. Limits add up to 575 s: one
  # device call (timeout_s 590).
  section tests 190 $PY -m pytest -q -p no:cacheprovider -n 12 -rfE \
      tests/kernels/test_kernels_*.py \
      tests/attention/test_{invariant_attention,triton_backend,windowed}.py \
      tests/executor/test_cuda_graph.py tests/project/test_gpu.py \
      tests/sample/test_sampling_distribution.py tests/models/test_lm_head_dtype.py \
      tests/sample/test_top_logprobs.py tests/executor/test_step_host_inputs.py \
      tests/kernels/test_row_invariant.py tests/kernels/test_triton_refusals.py \
      tests/lora/test_lora_kernel_ranks.py tests/sample/test_fused_draw_reports.py \
      tests/engine/test_batch_invariant.py::test_triton_backend_on_cuda \
      tests/engine/test_batch_invariant.py::test_triton_backend_unmerged_lora_on_cuda
  # What a wake-up costs with CUDA graphs (each bucket captured again), and what the weight
  # sync's checksums cost on a GPU (issue 25's goal: <= 10 % of a sync): neither run there yet.
  section graph_capture 45 $PY bench/graph_capture.py --device cuda --model-shape smollm2 \
      --dtype bfloat16
  section colocation 45 $PY bench/colocation.py --device cuda
  # What the batch-invariant mode costs on a GPU (issue 24's goal: <= 15 %): never measured.
  section batch_invariance 90 $PY bench/batch_invariance.py --device cuda \
      --model-shape smollm2-random --prompts 4 --n 8 --max-new 32 --repeats 2
  # With carried_kv="park" beside the re-prefilling partial rollouts (pinned host copies of the
  # carried K/V at each sleep): never run on a GPU yet.
  section partial 120 $PY bench/partial.py --device cuda --dtype bfloat16 --model-shape smollm2 \
      --cuda-graphs --kv-tokens 131072 --max-tokens 256 --mean-tokens 64 --steps 6 \
      --carried-kv recompute park
fi

if [ "$what" = moe ]; then
  moe_kernel_tests
  wait $!
fi

# Not in owed: its limits are spent; `moe` runs this after the MoE kernel tests.
if [ "$what" = bench ] || [ "$what" = moe ] || [ "$what" = all ]; then
  # One Qwen3-30B-A3B MoE layer: torch / Triton, Triton against dense matmul TFLOP/s.
  section moe_bench 150 $PY bench/moe.py --dtype bfloat16 --tokens 1,64,512,4096 \
      --naive-max-tokens 16
fi

if [ "$what" = bench ] || [ "$what" = owed ] || [ "$what" = all ]; then
  # One model each, one transformers run, an engine with CUDA graphs off then on. SmolLM2-135M's
  # shapes with random weights: its checkpoint (93 MB) does not fit the 64 MiB that travel.
  # Its "engine ms per step" line is the host's part on a GPU host after the 2026-12-06 cut
  # (docs/benchmarks.md, "Where the time goes"): owed.
  section engine_vs_hf_smollm2 85 $PY bench/engine_vs_hf.py --device cuda --model-shape smollm2 \
      --dtype bfloat16 --kv-tokens 400000 --cuda-graphs both
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  section kernels_bench 150 $PY bench/triton_kernels.py
  section engine_vs_hf_0.5b 120 $PY bench/engine_vs_hf.py --device cuda --model-shape 0.5b \
      --dtype bfloat16 --kv-tokens 400000 --cuda-graphs both
  section engine_vs_hf_0.5b_large 150 $PY bench/engine_vs_hf.py --device cuda \
      --model-shape 0.5b --dtype bfloat16 --kv-tokens 400000 --prompts 64 --max-new 256
fi

if [ "$what" = more ] || [ "$what" = all ]; then
  [ -f bench/colocation.py ] && section colocation 120 $PY bench/colocation.py --device cuda
  [ -f bench/spec.py ] && section spec 150 $PY bench/spec.py --device cuda
fi
