#!/usr/bin/env bash
# A rehearsal of benchmarks/device_check.sh on this machine, without a GPU and without a registry: a fresh
# venv (seeing the system's packages, as the GPU image has its own), the carried wheels and ampkit installed
# with --no-index, then the steps that need no GPU (the CUDA steps and the CPU suite are skipped). An
# install step that would need the network fails here first. The one step that uses a registry is the
# wheels' download (benchmarks/device_wheels.sh), skipped where the checkout's .whl/ holds them already.
# It runs in a copy of the checkout in a temporary folder: the wheels (.whl/) and ampkit's build (egg-info) land
# there, and the checkout is left as it was.
#   bash benchmarks/device_rehearsal.sh      (tests/test_device_scripts.py runs it in the test command)
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/repo"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then  # what git tracks, and new files it does not ignore
  git ls-files -co --exclude-standard -z | tar --null -T - -cf - | tar -xf - -C "$work/repo"
else
  tar --exclude=.git --exclude=.whl -cf - . | tar -xf - -C "$work/repo"
fi
[ -d .whl ] && cp -r .whl "$work/repo/"  # wheels downloaded for a device run: no second download
cd "$work/repo"
bash benchmarks/device_wheels.sh >/dev/null
# The Python that runs the rehearsal (the test suite's own: AMPKIT_REHEARSAL_PYTHON), else python3.
caller=${AMPKIT_REHEARSAL_PYTHON:-python3}
"$caller" -m venv --system-site-packages --without-pip "$work/venv"  # pip and setuptools: the caller's, as on the image
# --system-site-packages sees the base interpreter's packages only; where the caller is itself a venv (a user's
# plain venv holding torch), its own site-packages come in through a .pth file, ahead of the base's.
"$caller" -c 'import sysconfig; print("\n".join(dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))))' \
  > "$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/caller.pth"
mkdir "$work/out"
OUT="$work/out" PYTHON="$work/venv/bin/python" AMPKIT_DEVICE_SITE="$work/site" AMPKIT_DEVICE_REHEARSAL=1 \
  bash benchmarks/device_check.sh
PYTHONPATH="$work/site" "$work/venv/bin/python" benchmarks/device_fp8.py --device cpu --steps 2 \
  --out "$work/out/fp8-cpu.json" >/dev/null 2>&1 || { echo "device_fp8.py failed its smoke run"; exit 1; }
echo "rehearsal files: $(cd "$work/out" && ls | tr '\n' ' ')"
