#!/usr/bin/env bash
# The GPU check, as one prepared command of under 10 minutes for a borrowed GPU machine:
# the CUDA tests (CUDA-graph decode, mixed precision, peak memory), then the GPU benchmark with
# its runners alternated (benchmarks/gpu.py). Everything it measures lands in $OUT (default
# benchmarks/results/): cuda-tests.txt, gpu-<stamp>.md / .jsonl / .stderr.log.
#
#   python3 -m pip download ... -d .whl -r benchmarks/gpu-wheels.txt   # here, once (see that file)
#   bash benchmarks/device_check.sh                                      # there, with .whl carried
#
# The time limits are set so that the whole command ends inside 9.5 minutes on an H100 or H200
# even if a runner hangs: 150 s for the tests, then the benchmark stops starting runners at
# 330 s and stops any runner at 400 s.
set -u
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_decoding.py 2>&1 | tail -25 | tee "$OUT/cuda-tests.txt"
timeout 420 python3 benchmarks/gpu.py --out "$OUT" --budget-s 330 --hard-limit-s 400
