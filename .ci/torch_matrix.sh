#!/usr/bin/env bash
# The suite on the other torch releases ampkit supports: for each release after the first in pyproject.toml's
# [tool.ampkit] tested-torch, a plain venv with that torch from the registry (a CUDA build; it runs on a CPU), then
# the README's test command in it, verbatim but for the slow tier (-m "not slow": the README's own run of the whole
# suite on the first release is what CI's time allows on 2 cores; AMPKIT_MATRIX_SLOW=1 runs it here too). It keeps
# the torch it finds, as it does for a user who has one. A release the registry does not serve is a SKIPPED line,
# never a silent pass; any other failure fails the run.
# The oldest release also runs the compiled slow tier (tests/test_compiling.py -m slow: inductor, whose privates
# differ most from the first release's; 2.11's inductor failed every compile under an edited policy, which only
# that tier saw) and the offline device rehearsal (tests/test_device_scripts.py: in a plain venv, what a user has,
# it once saw the base interpreter's packages instead of the venv's, and a setuptools that could not build).
# AMPKIT_TORCH_VERSIONS="2.14.1 2.11.0" picks releases by hand; --list prints the releases and stops.
set -uo pipefail
cd "$(dirname "$0")/.."
versions=${AMPKIT_TORCH_VERSIONS:-$(python -c '
import tomllib
print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["tool"]["ampkit"]["tested-torch"][1:]))')}
if [ "${1:-}" = --list ]; then echo "$versions"; exit 0; fi
readme_test=$(grep -m1 -F "python -m pytest -q" README.md)
[ "${AMPKIT_MATRIX_SLOW:-0}" = 1 ] || readme_test="$readme_test -m 'not slow'"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
served=$(python -m pip index versions torch 2>/dev/null | sed -n 's/^Available versions: //p' | tr -d ' ')
oldest=$(printf '%s\n' $versions | sort -V | head -n1)
failed=()
for version in $versions; do
  start=$SECONDS
  if [[ ",$served," != *",$version,"* ]]; then
    echo "SKIPPED torch $version: the package registry does not serve it (the newest it serves: ${served%%,*})"
    continue
  fi
  echo "=== torch $version: a fresh venv, then the README's test command"
  python -m venv "$work/$version"
  if ! "$work/$version/bin/python" -m pip install -q "torch==$version"; then
    failed+=("$version (its install)")
    continue
  fi
  if (source "$work/$version/bin/activate" && cd "$PWD" && eval "$readme_test"); then
    echo "torch $version: the README's test command passed in $((SECONDS - start)) s"
  else
    failed+=("$version")
  fi
  if [ "$version" = "$oldest" ] && [ "${AMPKIT_MATRIX_SLOW:-0}" != 1 ]; then
    echo "=== torch $version, the oldest: the compiled slow tier and the device rehearsal"
    if (source "$work/$version/bin/activate" && python -m pytest -q -m slow tests/test_compiling.py \
          tests/test_device_scripts.py); then
      echo "torch $version: the compiled slow tier and the device rehearsal passed"
    else
      failed+=("$version (the compiled slow tier or the device rehearsal)")
    fi
  fi
  rm -rf "${work:?}/$version"
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED on torch ${failed[*]}"
  exit 1
fi
