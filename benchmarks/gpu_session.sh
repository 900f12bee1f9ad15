#!/usr/bin/env bash
# Every GPU check and GPU benchmark of the project, for a machine lent for a limited time (an H100/H200 with
# PyTorch, Triton and Lightning preinstalled and no network). Run from the repository root, in calls that each fit
# in ten minutes:
#
#   bash benchmarks/gpu_session.sh checks   # CUDA paths: gpu-check, Triton kernels vs their twins, pytest -m gpu, FSDP2
#   bash benchmarks/gpu_session.sh linear   # linear fwd+bwd 1024..8192: fp32, bf16, FP8 recipes, torchao; compiled
#   bash benchmarks/gpu_session.sh llama    # the linear layers of Llama-3-8B at 8192 tokens, same configurations
#   bash benchmarks/gpu_session.sh gpt      # 350M GPT step, same configurations, compiled (ROUNDS=8 by default)
#   bash benchmarks/gpu_session.sh stack    # four Llama-3-8B-shaped decoder layers, 8 x 1024 tokens, the same
#   bash benchmarks/gpu_session.sh lease    # one ~9-minute call for a 15-minute lease: the checks, then compiled linear
#   bash benchmarks/gpu_session.sh grouped  # native grouped FP8 (rowwise; MXFP8 on sm_100, else its skip reason) vs
#                                           # the emulation, then MoE grouped GEMM
#                                           # fwd+bwd (rowwise FP8 vs bf16 torch._grouped_mm, with profiles) at
#                                           # DeepSeek-V3 and Qwen3-30B-A3B expert shapes with token skew, and the
#                                           # weight cache's host time with accumulation (~4 minutes on an H200)
#   bash benchmarks/gpu_session.sh grouped-triton  # the Triton grouped FP8 GEMM: checked against float64 math on
#                                           # CUDA, then timed against bf16 torch._grouped_mm and torch._scaled_grouped_mm,
#                                           # GEMM alone and the whole fwd+bwd step, DeepSeek-V3 and Qwen3-30B-A3B expert
#                                           # shapes with skewed routing (under 3 minutes; no pytest needed)
#   bash benchmarks/gpu_session.sh grouped-tokens  # the grouped step (rowwise, MXFP8 on sm_100) vs bf16 as tokens per
#                                           # expert grow (4096 and 16384 tokens) and with 4 micro-batches sharing one
#                                           # weight cast, beside the roofline ceiling of each row (~4 minutes)
#   bash benchmarks/gpu_session.sh traced   # compiled rowwise/blockwise/MXFP8 layer step vs eager, bit for bit, and
#                                           # its CUDA kernels per step (torch.profiler); under a minute on an H100
#   bash benchmarks/gpu_session.sh nvfp4    # the Triton NVFP4 cast's bytes vs the reference on CUDA (shapes up to
#                                           # 4096x4096, both roundings, RHT on/off, 1x16/16x16) and its timing (<2 min);
#                                           # on sm_100+ the layer's native FP4 GEMMs vs the emulation and float64 math
#                                           # on the same operands, timed vs bf16 (sm_90: prints why it skips)
#   bash benchmarks/gpu_session.sh experts  # the FP8 experts compiled fullgraph on CUDA vs eager, and the experts'
#                                           # FP8 all-gather under FSDP2 on NCCL vs a high-precision gather
#   bash benchmarks/gpu_session.sh checkpoint  # activation checkpointing of FP8 linears and experts on CUDA (both
#                                           # checkpoint modes, every recipe the GPU runs) vs the unchecked run (<1 min)
#   bash benchmarks/gpu_session.sh dry-run  # on any machine: list each call's steps, install the wheels offline
#
# Everything a call writes lands in one archive, $OUT/gpu-<mode>.tar.gz (OUT defaults to ./gpu-results), holding one
# folder gpu-<mode>-<date>/ with a log per step and the benchmark run folders: `tar -xzf gpu-<mode>.tar.gz -C
# benchmarks/results` files it next to the other results. Nothing is downloaded: the package is installed from
# this checkout without dependencies (no step imports hydra or omegaconf), and the wheels the GPU image lacks
# (torchao, for the torchao.float8 peer rows) come from wheels/, filled here beforehand by `make gpu-wheels`
# (git-ignored; name it in the call's carry). They are installed into a private folder put on PYTHONPATH.
# Each step's whole log is also appended to $OUT/gpu-<mode>.log as it finishes, so a call cut off at its time limit
# still brings back every step that ended.
set -u -o pipefail
mode=${1:-checks}
out=${OUT:-gpu-results}
python=${PYTHON:-python3}
site=$(mktemp -d)/site
export PYTHONUNBUFFERED=1

install_wheels() {  # the wheels in wheels/, offline, into $site (on PYTHONPATH from then on)
  ls wheels/*.whl >/dev/null 2>&1 || { echo "wheels/: none (make gpu-wheels fetches them)"; return 0; }
  "$python" -m pip install -q --no-index --no-deps --no-compile --target "$site" wheels/*.whl || return 1
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  echo "wheels/: installed offline: $(cd wheels && ls *.whl | tr '\n' ' ')"
}

if [ "$mode" = dry-run ]; then
  for call in checks linear llama gpt stack grouped grouped-tokens grouped-triton nvfp4 traced checkpoint experts lease; do
    echo "== call '$call' runs:"
    sed -n "/^  $call)/,/;;/p" "$0" | grep -o 'step [a-z0-9_]* .*' | sed 's/^step /   /'
  done
  install_wheels || { echo "wheels did not install offline"; exit 1; }
  "$python" -c "import torchao.float8; print('torchao.float8 imports:', torchao.__version__)" || exit 1
  exit 0
fi

work=$(mktemp -d)/gpu-$mode-$(date -u +%Y%m%d-%H%M)
mkdir -p "$out" "$work"
"$python" -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$work/install.log" 2>&1 \
  || { cat "$work/install.log"; exit 1; }
"$python" -c "import torchao" 2>/dev/null || install_wheels >>"$work/install.log" 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$work/device.txt" 2>&1
"$python" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >>"$work/device.txt" 2>&1
"$python" -c "import torchao; print('torchao', torchao.__version__)" >>"$work/device.txt" 2>&1 || echo "torchao: not installed" >>"$work/device.txt"
"$python" -m pip list 2>/dev/null | grep -i -E "^(torch|triton|lightning|pytorch-lightning|pytest|pytest-xdist|setuptools|wheel|pip|nvidia-cublas[a-z0-9-]*) " >>"$work/device.txt"
"$python" -m fp8_lightning.capability_table >>"$work/device.txt" 2>&1  # which GEMM serves each recipe here
cat "$work/device.txt" >>"$out/gpu-$mode.log"

failed=0
step() {  # step NAME COMMAND...: run with a time limit, keep its log, print its tail
  local name=$1; shift
  timeout "${STEP_TIMEOUT:-540}" "$@" >"$work/$name.log" 2>&1
  local rc=$?
  [ "$rc" -eq 0 ] || failed=1
  echo "== $name: exit $rc"
  tail -n 8 "$work/$name.log"
  { echo "===== $name: exit $rc"; cat "$work/$name.log"; } >>"$out/gpu-$mode.log"
}

case "$mode" in
  checks)
    step gpu_check "$python" -m benchmarks gpu-check
    step kernels "$python" -m benchmarks kernels-gpu --out "$work/kernels_gpu.md"
    step pytest_gpu "$python" -m pytest -q -p no:cacheprovider -m gpu \
      tests/kernels/test_gpu.py tests/lightning/test_gpu.py tests/optim/test_fused_adam_kernel.py tests/test_state_device.py tests/core/test_grouped_mm.py \
      tests/core/test_nvfp4_grouped.py tests/core/test_nvfp4_fsdp_wire.py tests/core/test_activation_checkpointing.py
    step fsdp "$python" -m benchmarks fsdp-gpu-check
    ;;
  linear)
    step linear "$python" -m benchmarks linear --suite gpu --compile --out "$work/perf-linear-gpu"
    ;;
  llama)
    step llama "$python" -m benchmarks linear --suite gpu --llama --compile --out "$work/perf-linear-llama-gpu"
    ;;
  gpt)
    step gpt "$python" -m benchmarks gpt --suite gpu --compile --rounds "${ROUNDS:-8}" --out "$work/perf-gpt-gpu"
    ;;
  stack)
    step stack "$python" -m benchmarks llama-stack --compile --rounds "${ROUNDS:-8}" \
      --out "$work/perf-llama-stack-gpu"
    ;;
  grouped)  # also the weight cache's GPU rule (a reuse casts again, no device sync) and its host time
    STEP_TIMEOUT=60 step grouped_check "$python" -m benchmarks grouped-gpu-check --out "$work/grouped_gpu_check.md"
    # MXFP8 on sm_100: native grouped GEMMs vs emulation, then timed vs bf16; elsewhere it prints the skip reason
    STEP_TIMEOUT=120 step mx_grouped "$python" -m benchmarks mx-grouped-gpu --rounds 10 --out "$work/mx_grouped_gpu.md"
    STEP_TIMEOUT=90 step pytest_grouped "$python" -m pytest -q -p no:cacheprovider -m gpu \
      tests/core/test_grouped_native.py tests/core/test_grouped_mm.py tests/kernels/test_grouped_cast.py tests/kernels/test_grouped_gemm.py \
      tests/core/test_grouped_batched_casts.py tests/core/test_nvfp4_grouped_batched.py \
      tests/core/test_weight_cache.py tests/core/test_mx_grouped.py tests/core/test_nvfp4_fsdp_experts_batched.py tests/core/test_group_layouts.py
    STEP_TIMEOUT=120 step grouped "$python" -m benchmarks grouped --suite gpu --recipes rowwise --baselines \
      --rounds 3 --profile --out "$work/perf-grouped-gpu"
    STEP_TIMEOUT=40 step host_time_accumulate "$python" -m benchmarks host-time --device cuda --modes eager \
      --rounds 100 --accumulate 4 --checksum-off-rows --out "$work/host_time_accumulate.md"
    ;;
  grouped-tokens)  # where FP8 experts pay off: more tokens per expert, and micro-batches sharing the weight cast
    STEP_TIMEOUT=110 step grouped_tokens "$python" -m benchmarks grouped --suite gpu --experts 64 --recipes rowwise \
      mxfp8 --baselines --tokens 4096 16384 --rounds 3 --out "$work/perf-grouped-tokens"
    STEP_TIMEOUT=110 step grouped_microbatches "$python" -m benchmarks grouped --suite gpu --experts 64 --recipes \
      rowwise mxfp8 --baselines --tokens 4096 16384 --microbatches 4 --rounds 3 --out "$work/perf-grouped-microbatches"
    ;;
  grouped-triton)  # check first (exit 1 skips the timings), then GEMM-alone and whole-step timings
    STEP_TIMEOUT=175 step grouped_triton "$python" -m benchmarks grouped-triton --rounds 5 --out "$work/grouped_triton.md"
    ;;
  traced)  # the compiled fine-grained layer: same bits as eager, CUDA kernels counted
    STEP_TIMEOUT=150 step traced_gpu_check "$python" -m benchmarks traced-gpu-check --out "$work/traced_gpu_check.md"
    ;;
  nvfp4)  # the cast needs no FP4 tensor cores (sm89+); the native GEMM check needs sm_100+ (else it says why it skips)
    STEP_TIMEOUT=110 step nvfp4 "$python" -m benchmarks nvfp4-gpu --out "$work/nvfp4_gpu.md"
    STEP_TIMEOUT=150 step nvfp4_gemm "$python" -m benchmarks nvfp4-gemm-gpu --out "$work/nvfp4_gemm_gpu.md"
    ;;
  checkpoint)  # activation checkpointing on CUDA (backward on autograd's device thread) vs the unchecked run, bit for bit
    STEP_TIMEOUT=150 step pytest_checkpoint "$python" -m pytest -q -p no:cacheprovider -m gpu \
      tests/core/test_activation_checkpointing.py tests/core/test_recompute_across_steps.py tests/core/test_double_backward.py
    ;;
  experts)  # the FP8 experts compiled fullgraph on CUDA vs eager; their FP8 all-gather under FSDP2 on NCCL
    STEP_TIMEOUT=150 step pytest_experts_compile "$python" -m pytest -q -p no:cacheprovider -m gpu \
      tests/perf/test_compile_experts.py
    STEP_TIMEOUT=120 step fsdp_experts "$python" -m benchmarks fsdp-experts-gpu-check
    ;;
  lease)  # everything that fits one call: each step capped so the whole call ends inside ~9 minutes
    STEP_TIMEOUT=140 step gpu_check "$python" -m benchmarks gpu-check
    STEP_TIMEOUT=90 step kernels "$python" -m benchmarks kernels-gpu --out "$work/kernels_gpu.md"
    STEP_TIMEOUT=90 step pytest_gpu "$python" -m pytest -q -p no:cacheprovider -m gpu \
      tests/kernels/test_gpu.py tests/lightning/test_gpu.py tests/optim/test_fused_adam_kernel.py tests/test_state_device.py \
      tests/core/test_grouped_mm.py
    STEP_TIMEOUT=40 step fsdp "$python" -m benchmarks fsdp-gpu-check
    STEP_TIMEOUT=60 step host_time "$python" -m benchmarks host-time --device cuda --modes eager --rounds 100
    STEP_TIMEOUT=150 step linear "$python" -m benchmarks linear --suite gpu --compile --sizes 2048 8192 \
      --out "$work/perf-linear-gpu-compiled"
    ;;
  *)
    echo "usage: bash benchmarks/gpu_session.sh checks|linear|llama|gpt|stack|grouped|grouped-tokens|grouped-triton|nvfp4|traced|checkpoint|experts|lease|dry-run (got '$mode')" >&2
    exit 2
    ;;
esac

tar -czf "$out/gpu-$mode.tar.gz" -C "$(dirname "$work")" "$(basename "$work")"
echo "results: $out/gpu-$mode.tar.gz"
exit "$failed"
