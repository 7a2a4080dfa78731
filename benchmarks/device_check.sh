#!/usr/bin/env bash
# One prepared run for a GPU machine that reaches no package registry (the H200 image: Python 3.12,
# torch 2.11 with CUDA, no torchao, no torch-optimi, no expecttest). Carry the wheels: `bash benchmarks/device_wheels.sh`
# here first, then run this with carry=[".whl"]. Every step is bounded by `timeout`; everything lands in
# $OUT (log.txt, steps.txt, env.json, compare-<model>-cuda/results.json, autocast-cuda/autocast.json, fp8-cuda.json:
# at most 8 files, one folder deep; `cp -r $OUT/compare-*-cuda $OUT/fp8-cuda.json $OUT/autocast-cuda/autocast.json
# benchmarks/results/h200-cuda/ && python benchmarks/make_benchmarks_md.py` puts the records, labelled with the GPU
# and the torch version, into BENCHMARKS.md).
# Steps, in order of value, with their budgets (9 min in all: one device call, inside its 10-minute limit):
#   setup      45 s  wheels and ampkit installed offline (--no-index --no-deps), versions and `ampkit env`
#   gpu-tests  60 s  pytest -m gpu: scaler vs GradScaler, autocast vs torch.autocast, float32 compute, FP8
#   compare   240 s  ampkit compare on CUDA at the size it chooses there (--size auto, its default): ResNet-18's
#                    default comparison (fp16 and bf16, O1 and O2), then the GPT's fp32, bf16 O2, fp16 O2 with
#                    the dynamic scaler, FP8 delayed and current (O2)
#   fp8        45 s  native FP8 (delayed and current scaling) against emulation over 20 steps
#   autocast  150 s  benchmarks/bench_autocast.py on CUDA at the GPT's chosen size: ampkit's policies against
#                    torch.autocast's step, eager and compiled
# The CPU suite on this torch (2.11) is CI's own (its oldest-release venv), so it is not repeated here.
# AMPKIT_DEVICE_REHEARSAL=1 (benchmarks/device_rehearsal.sh) runs the offline install and the CPU smoke
# steps on a machine without a GPU and skips the CUDA steps and the benchmark.
#   bash benchmarks/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
REHEARSAL=${AMPKIT_DEVICE_REHEARSAL:-0}
SITE=${AMPKIT_DEVICE_SITE:-/tmp/ampkit-site}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
failed=()

step() {  # step NAME SECONDS COMMAND...: run it bounded, log to $OUT/log.txt, remember a failure
  local name=$1 budget=$2; shift 2
  echo "== $name (at most ${budget} s)" | tee -a "$OUT/log.txt"
  local start=$SECONDS
  timeout --kill-after=10 "$budget" "$@" 2>&1 | tee -a "$OUT/log.txt"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - start)) s" | tee -a "$OUT/steps.txt" "$OUT/log.txt"
  [ "$rc" -eq 0 ] || failed+=("$name")
}

setup() {
  set -e
  ls .whl/*.whl >/dev/null 2>&1 || { echo "no wheels in .whl/: run bash benchmarks/device_wheels.sh first"; exit 1; }
  # --target: the image's own packages stay as they are; the carried ones come first on the path.
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" .whl/*.whl
  # ampkit's own build through the carried setuptools (a bdist_wheel of its own): a fresh venv's setuptools 65 has
  # none without the wheel package, and offline nothing can fetch it
  PYTHONPATH="$SITE" "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .
  PYTHONPATH="$SITE" "$PY" - <<'PY'
import sys, torch, torchao, optimi, ampkit
from ampkit import _torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| GPU", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
print("torchao", torchao.__version__, torchao.__file__)
print("torch-optimi", optimi.__file__)
print("torch privates missing here:", _torch.missing() or "none")
PY
  PYTHONPATH="$SITE" "$PY" -m ampkit.cli.main env --json > "$OUT/env.json"
}
export -f setup
export PY SITE OUT

step setup 45 bash -c setup
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

# The GPT's comparison: the formats the issue of a GPU-sized compare names, each at O2 beside float32
GPT_SETTINGS=(--precision fp32 bf16 fp16 fp8 fp8-current --opt-level O2 --loss-scale dynamic --steps 200)
if [ "$REHEARSAL" = 1 ]; then
  step gpu-tests 60 "$PY" -m pytest -q -p no:cacheprovider -m gpu --collect-only
  # the device's commands with their flags, on a tiny MLP (the size chosen by measurement, as on the GPU)
  step compare 90 "$PY" -m ampkit.cli.main compare --model mlp --steps 2 --batch-size 8 --precision fp32 bf16 \
    --opt-level O1 --size auto --quiet --out "$(mktemp -d)/run"
  step autocast 30 "$PY" benchmarks/bench_autocast.py --device cpu --size large --compile --help
else
  step gpu-tests 60 "$PY" -m pytest -q -p no:cacheprovider -p no:warnings -rfE --tb=short -m gpu
  for model in resnet18 gpt; do
    dir=$(mktemp -d)/run
    if [ "$model" = gpt ]; then settings=("${GPT_SETTINGS[@]}"); budget=150; else settings=(); budget=90; fi
    step "compare-$model" "$budget" "$PY" -m ampkit.cli.main compare --device cuda --model "$model" \
      "${settings[@]}" --quiet --out "$dir"
    # as benchmarks/results/ files the records: copy these folders there, then make_benchmarks_md.py renders them
    [ -f "$dir/results.json" ] && mkdir -p "$OUT/compare-$model-cuda" && cp "$dir/results.json" "$OUT/compare-$model-cuda/"
  done
  step fp8 45 "$PY" benchmarks/device_fp8.py --out "$OUT/fp8-cuda.json"
  size=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['config'].get('size', 'large'))" \
    "$OUT/compare-gpt-cuda/results.json" 2>/dev/null || echo large)
  [ "$size" = small ] && size=medium  # the bench's own small workloads are not compare's small ones
  step autocast 150 "$PY" benchmarks/bench_autocast.py --device cuda --size "$size" --compile --repeats 11 \
    --out "$OUT/autocast-cuda"
fi

echo "steps that failed: ${failed[*]:-none}" | tee -a "$OUT/steps.txt"
[ ${#failed[@]} -eq 0 ]
