#!/usr/bin/env bash
# The GPU check, prepared for a borrowed GPU machine, in two commands of under 10 minutes each:
#
#   bash benchmarks/device_check.sh ppo    # the CUDA tests, then ppo_lab (growing cache, CUDA graph) and TRL's PPOTrainer
#   bash benchmarks/device_check.sh grpo   # ppo_lab's GRPO preset and TRL's GRPOTrainer
#   bash benchmarks/device_check.sh fsdp2  # the frozen-weights tests on CUDA, then ppo_lab unsharded, FSDP2 on a world of one, frozen weights in float32
#   bash benchmarks/device_check.sh memory # estimate_memory against the measured peak: FSDP2 on a world of one, and Qwen2.5-1.5B's shape
#
# Each runner runs twice, alternated (benchmarks/gpu.py), 6 updates a round. Everything lands in
# $OUT (default benchmarks/results/): device.txt, cuda-tests.txt, gpu-<stamp>.md / .jsonl /
# .stderr.log. The time limits keep each command inside 9.5 minutes even if a runner hangs;
# a round that would start past the budget is skipped and the table says so. How long the
# runners take was estimated from the 2026-11-24 H100 runs (ppo_lab about 70 s a round with
# its set-up, TRL's PPO about 90 s), not measured with these changes.
#
# TRL and its dependencies travel as wheels (.whl/, carried; see benchmarks/gpu-wheels.txt).
set -u
PART=${1:-ppo}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
case "$PART" in
  ppo)
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tail -25 | tee "$OUT/cuda-tests.txt"
    timeout 440 python3 benchmarks/gpu.py --out "$OUT" --only ppo_lab_graph,trl,ppo_lab_separate --budget-s 330 --hard-limit-s 430
    ;;
  grpo)
    timeout 560 python3 benchmarks/gpu.py --out "$OUT" --only ppo_lab_grpo,trl_grpo --budget-s 450 --hard-limit-s 550
    ;;
  fsdp2)
    # (tests/test_sharding.py launches 2 CPU processes over gloo by design: a 1-GPU machine adds nothing to it)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_frozen_weights.py 2>&1 | tail -25 | tee "$OUT/frozen-weights-tests.txt"
    timeout 420 python3 benchmarks/gpu.py --out "$OUT" --only ppo_lab_separate,ppo_lab_fsdp2,ppo_lab_frozen_fp32 --budget-s 320 --hard-limit-s 410
    ;;
  memory)
    # estimate_memory against the measured peak: FSDP2 on a world of one, then one iteration at Qwen2.5-1.5B's shape
    timeout 200 python3 benchmarks/gpu_memory.py --out "$OUT" --only base,fsdp2 --timeout-s 90 --budget-s 100
    timeout 380 python3 benchmarks/gpu_memory.py --out "$OUT" --only qwen1.5b --updates 1 --timeout-s 360 --budget-s 10
    ;;
  *)
    echo "usage: bash benchmarks/device_check.sh ppo|grpo|fsdp2|memory" >&2
    exit 2
    ;;
esac
