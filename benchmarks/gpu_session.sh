#!/usr/bin/env bash
# Every GPU check and GPU benchmark of the project, for a machine lent for a limited time (an H100/H200 with
# PyTorch, Triton and Lightning preinstalled and no network). Run from the repository root, in calls that each fit
# in ten minutes:
#
#   bash benchmarks/gpu_session.sh checks   # CUDA paths: gpu_check, Triton kernels vs their twins, pytest -m gpu, FSDP2
#   bash benchmarks/gpu_session.sh linear   # linear fwd+bwd 1024..8192: fp32, bf16, FP8 recipes, torchao; compiled
#   bash benchmarks/gpu_session.sh gpt      # 350M GPT step, same configurations, compiled (ROUNDS=8 by default)
#
# Everything lands in one archive, $OUT/gpu-<mode>.tar.gz (OUT defaults to ./gpu-results), with a log per step;
# the benchmark run folders inside it go to benchmarks/results/ once checked. Nothing is downloaded: the package is
# installed from this checkout without dependencies (hydra is not needed by these steps). The torchao.float8 peer
# runs when torchao is installed there or its wheel was brought along: `pip download torchao==0.18.0 --no-deps -d
# wheels` beforehand (wheels/ is git-ignored; carry it), and it is installed from there.
set -u -o pipefail
mode=${1:-checks}
out=${OUT:-gpu-results}
work=$(mktemp -d)
mkdir -p "$out"
export PYTHONUNBUFFERED=1

python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$work/install.log" 2>&1 \
  || { cat "$work/install.log"; exit 1; }
if ! python3 -c "import torchao" 2>/dev/null && ls wheels/torchao-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index wheels/torchao-*.whl >>"$work/install.log" 2>&1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$work/device.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >>"$work/device.txt" 2>&1
python3 -c "import torchao; print('torchao', torchao.__version__)" >>"$work/device.txt" 2>&1 || echo "torchao: not installed" >>"$work/device.txt"

failed=0
step() {  # step NAME COMMAND...: run with a time limit, keep its log, print its tail
  local name=$1; shift
  timeout "${STEP_TIMEOUT:-540}" "$@" >"$work/$name.log" 2>&1
  local rc=$?
  [ "$rc" -eq 0 ] || failed=1
  echo "== $name: exit $rc"
  tail -n 8 "$work/$name.log"
}

case "$mode" in
  checks)
    step gpu_check python3 benchmarks/gpu_check.py
    step kernels python3 benchmarks/kernels_gpu.py --out "$work/kernels_gpu.md"
    step pytest_gpu python3 -m pytest -q -p no:cacheprovider -m gpu \
      tests/kernels/test_gpu.py tests/lightning/test_gpu.py tests/optim/test_fused_adam_kernel.py
    step fsdp python3 benchmarks/fsdp_gpu_check.py
    ;;
  linear)
    step linear python3 benchmarks/bench_linear.py --suite gpu --compile --out "$work/perf-linear-gpu"
    ;;
  gpt)
    step gpt python3 benchmarks/bench_gpt.py --suite gpu --compile --rounds "${ROUNDS:-8}" --out "$work/perf-gpt-gpu"
    ;;
  *)
    echo "usage: bash benchmarks/gpu_session.sh checks|linear|gpt (got '$mode')" >&2
    exit 2
    ;;
esac

tar -czf "$out/gpu-$mode.tar.gz" -C "$work" .
echo "results: $out/gpu-$mode.tar.gz"
exit "$failed"
