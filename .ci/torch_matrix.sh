#!/usr/bin/env bash
# The suite on the other torch releases ampkit supports: for each release after the first in pyproject.toml's
# [tool.ampkit] tested-torch, a plain venv with that torch from the registry (a CUDA build; it runs on a CPU), then
# the README's test command in it, verbatim but for the tier (the README's own run of the whole suite on the first
# release is what CI's time allows on 2 cores once; AMPKIT_MATRIX_SLOW=1 runs the whole suite on every release). It
# keeps the torch it finds, as it does for a user who has one. A release the registry does not serve is a SKIPPED
# line, never a silent pass; any other failure fails the run. The tiers, by release:
# - the newest and the oldest: the fast tier (-m "not slow"), where torch's privates and defaults move first;
# - the oldest also the compiled slow tier (tests/test_compiling.py -m slow: inductor, whose privates differ most from
#   the first release's; 2.11's inductor failed every compile under an edited policy, which only that tier saw) and
#   the offline device rehearsal (tests/test_device_scripts.py: in a plain venv, what a user has, it once saw the
#   base interpreter's packages instead of the venv's, and a setuptools that could not build);
# - a release between them: the loans tier (LOANS below), the tests of each torch private ampkit calls, of torch's
#   autocast lists and of the call shapes users write, so that every tested release runs every call form ampkit
#   makes through a private (the fast tier on four releases would not fit CI's 90 minutes).
# This machine's pip configuration caps torch at the releases on its disk (a constraints file); a user's has no
# such cap, so the venvs here are installed with an empty constraints file (PIP_CONSTRAINT=/dev/null), as a user's.
# AMPKIT_TORCH_VERSIONS="2.14.1 2.11.0" picks releases by hand; --list prints the releases and stops.
# CI's time: .ci/run hands on AMPKIT_CI_LEFT_S, the seconds left of its budget, and AMPKIT_CI_README_S, how long the
# README's whole suite took on this machine. Each release's need is estimated from that (its tier's share of the
# whole suite, as CI's replays on a 2-core machine measured them: the fast tier 85%, the loans tier 15%, the oldest's
# compiled slow tier and rehearsal 30%; an install 300 s, then as long as the last one took). The newest goes first,
# then the oldest, then the rest; a fast tier that does not fit runs the loans tier, and what does not fit at all is a
# SKIPPED line naming the command that runs it. Without AMPKIT_CI_LEFT_S (run by hand) everything runs.
set -uo pipefail
cd "$(dirname "$0")/.."
versions=${AMPKIT_TORCH_VERSIONS:-$(python -c '
import tomllib
print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["tool"]["ampkit"]["tested-torch"][1:]))')}
if [ "${1:-}" = --list ]; then echo "$versions"; exit 0; fi
readme_test=$(grep -m1 -F "python -m pytest -q" README.md)
fast_test="$readme_test -m 'not slow'"
[ "${AMPKIT_MATRIX_SLOW:-0}" = 1 ] && fast_test=$readme_test
# The loans tier: the shim's own tests, the call shapes, torch's autocast lists, and the modules whose features call
# each private or stand where one stood (the dispatch-mode class, the Autocast-key kernels' schemas through torch.fx,
# checkpointing's context_fn, the compiled features, the fused unscale and copies, tensor attributes, the containers
# ampkit walks against torch's pytree).
LOANS="tests/test_torch_shim.py tests/test_call_shapes.py tests/test_torch_autocast_lists.py tests/test_op_lists.py
  tests/test_compute.py tests/test_checkpointing.py tests/test_compiling.py tests/test_autocast.py tests/test_scaler.py
  tests/test_master.py tests/test_trees.py"
loans_test="$readme_test -m 'not slow' $(echo $LOANS)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
served=$(python -m pip index versions torch 2>/dev/null | sed -n 's/^Available versions: //p' | tr -d ' ')
oldest=$(printf '%s\n' $versions | sort -V | head -n1)
newest=$(printf '%s\n' $versions | sort -V | tail -n1)
export PIP_CONSTRAINT=/dev/null
left=${AMPKIT_CI_LEFT_S:-} whole=${AMPKIT_CI_README_S:-0} begun=$SECONDS install_s=300
remaining() { echo $((left - (SECONDS - begun))); }
need() { echo $((install_s + whole * $1 / 100)); }  # need SHARE: an install and SHARE% of the whole suite's time
fits() { [ -z "$left" ] || [ "$(remaining)" -ge "$1" ]; }
out_of_time() {  # out_of_time VERSION WHAT SECONDS
  echo "SKIPPED torch $1: $2 needs about $3 s on this machine (the README's whole suite took $whole s here)," \
       "$(remaining) s of CI's budget are left: run it with AMPKIT_TORCH_VERSIONS=$1 bash .ci/torch_matrix.sh"
}
failed=()
for version in $(printf '%s\n' "$newest" "$oldest" $versions | awk '!seen[$0]++'); do
  start=$SECONDS
  if [[ ",$served," != *",$version,"* ]]; then
    echo "SKIPPED torch $version: the package registry does not serve it (the newest it serves: ${served%%,*})"
    continue
  fi
  tier=fast test=$fast_test share=85
  if [ "$version" != "$oldest" ] && [ "$version" != "$newest" ] && [ "${AMPKIT_MATRIX_SLOW:-0}" != 1 ]; then
    tier=loans test=$loans_test share=15
  fi
  if ! fits "$(need $share)"; then
    if [ $tier = fast ] && fits "$(need 15)"; then
      echo "torch $version: the loans tier, not the fast tier (about $(need 85) s here;" \
           "$(remaining) s of CI's budget left)"
      tier=loans test=$loans_test
    else
      out_of_time "$version" "its loans tier" "$(need 15)"
      continue
    fi
  fi
  echo "=== torch $version: a fresh venv, then the README's test command, the $tier tier"
  python -m venv "$work/$version"
  if ! "$work/$version/bin/python" -m pip install -q "torch==$version"; then
    failed+=("$version (its install)")
    continue
  fi
  install_s=$((SECONDS - start))
  if (source "$work/$version/bin/activate" && cd "$PWD" && eval "$test"); then
    echo "torch $version: the README's test command, the $tier tier, passed in $((SECONDS - start)) s"
  else
    failed+=("$version")
  fi
  if [ "$version" = "$oldest" ] && [ "${AMPKIT_MATRIX_SLOW:-0}" != 1 ] && ! fits $((whole * 30 / 100)); then
    out_of_time "$version" "its compiled slow tier and the device rehearsal" $((whole * 30 / 100))
  elif [ "$version" = "$oldest" ] && [ "${AMPKIT_MATRIX_SLOW:-0}" != 1 ]; then
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
