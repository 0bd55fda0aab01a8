#!/usr/bin/env bash
# The GPU checks, as one prepared run on a lent device machine (one CUDA GPU; no vLLM, Ray or
# Transformer-Engine there: those wheels are too large to carry). From the build machine:
#   bash scripts/device_wheels.sh     # once, fills .whl/
#   then copy the checkout (with .whl/) to the GPU machine and run: bash scripts/device_check.sh
# It runs the advantage benchmark on CUDA first (issue #2's speed-up), then the gpu-tier tests that need
# no vLLM/Ray (advantage estimators + Triton scatter on CUDA, the Megatron actor on CUDA with NCCL in
# float32 and bfloat16, the LoRA-adapted actor on CUDA against transformers + peft), then the actor benchmark
# at TP1 without and with LoRA. tests/rollout/test_gpu_sync.py (weight sync through vLLM's ipc / nccl
# transports, mgigpo_ipc / mgigpo_nccl) runs too, and skips itself where vLLM and Ray are not installed (the
# lent machine's case; docs/gpu-install.md runs it on a full GPU install). Logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-/tmp/device_check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "installing .whl/ failed: run scripts/device_wheels.sh here first"; exit 2; }
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, megatron.core as m; print('torch', torch.__version__, 'triton', triton.__version__, 'mcore', m.__version__)"
status=0
timeout 120 python3 benchmarks/advantage.py --device cuda --repeats 5 --oracle-repeats 1 \
  2>&1 | tee "$OUT/advantage_cuda.log" || status=1
timeout 330 python3 -m pytest -p no:cacheprovider -m gpu -rA -s \
  tests/algo/test_cuda.py tests/actor/test_actor_cuda.py tests/actor/test_lora_cuda.py \
  tests/rollout/test_gpu_sync.py \
  2>&1 | tee "$OUT/pytest_gpu.log" || status=1
timeout 120 python3 benchmarks/actor.py --device cuda --nproc 1 --layouts tp1 --lora off,on --rows 64 \
  2>&1 | tee "$OUT/actor_cuda.log" || status=1
echo "device_check status=$status"
exit $status
