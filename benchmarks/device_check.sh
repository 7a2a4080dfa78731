#!/usr/bin/env bash
# One prepared run for a machine with a CUDA GPU: the CUDA tests, then the CUDA rows of the
# `ampkit compare` records. Results land in benchmarks/results/ (and are copied to $OUT when set,
# for a remote device run); then `python benchmarks/make_benchmarks_md.py` adds them to BENCHMARKS.md.
#   bash benchmarks/device_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip show -q torch 2>/dev/null || python -m pip install torch==2.13.0
python -m pip install -q -e ".[test]"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device here'; print(torch.cuda.get_device_name(0))"
python -m pytest -q -p no:warnings -m gpu 2>&1 | tee /tmp/ampkit-gpu-tests.log
python benchmarks/bench_compare.py --device cuda
if [ -n "${OUT:-}" ]; then
  cp /tmp/ampkit-gpu-tests.log "$OUT/"
  for d in benchmarks/results/compare-*-cuda; do cp "$d/results.json" "$OUT/$(basename "$d").json"; done
fi
