#!/usr/bin/env bash
# The wheels benchmarks/device_check.sh carries to the GPU image, which reaches no registry and lacks
# torchao and torch-optimi: downloaded here into .whl/ (git ignores it; `run` carries it: carry=[".whl"]).
# Python 3.12 x86-64, as the image. Skips what is already there.
#   bash benchmarks/device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# ampkit[fp8], ampkit[pure16] and expecttest (PyTorch's autocast test lists import it), as CI tests them; setuptools
# to build ampkit offline where the Python's own is too old to (a fresh venv's 65, without bdist_wheel)
WHEELS=("torchao==0.18.0" "torch-optimi==0.3.3" "expecttest==0.3.0" "setuptools==80.9.0")
mkdir -p .whl
for wheel in "${WHEELS[@]}"; do
  name=${wheel%%==*}; version=${wheel##*==}
  ls .whl/"${name//-/_}"-"$version"-*.whl >/dev/null 2>&1 && continue
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$wheel"
done
ls .whl
