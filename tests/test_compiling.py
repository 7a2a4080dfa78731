"""precision/compiling.py across processes: inductor's on-disk caches never hand one policy's graph to
another (issue 23's cache test). Process 1 compiles under the default policy with a fixed
TORCHINDUCTOR_CACHE_DIR; process 2, with the same directory, runs under an edited policy: eager dtypes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_RUN = """
import json, sys, warnings, torch
warnings.simplefilter("ignore")
from ampkit import Policy, autocast
def f(x, w):
    return torch.mm(x, w), torch.layer_norm(x, (8,))
compiled = torch.compile(f, backend="inductor")
torch.manual_seed(0)
x, w = torch.randn(4, 8), torch.randn(8, 8)
native = Policy.default("cpu", torch.bfloat16, compute="native")
policy = native if sys.argv[1] == "default" else native.with_ops(allow=["layer_norm"], deny=["mm"])
with autocast(policy):
    got, eager = compiled(x, w), f(x, w)
print(json.dumps({"compiled": [str(t.dtype) for t in got], "eager": [str(t.dtype) for t in eager],
                  "close": all(torch.allclose(a.float(), b.float(), atol=1e-2) for a, b in zip(got, eager))}))
"""


@pytest.mark.slow  # a first inductor compile: about 20 s here
def test_a_graph_cached_on_disk_under_one_policy_never_runs_under_another(tmp_path: Path) -> None:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    outcomes = {}
    for policy in ("default", "edited"):
        done = subprocess.run([sys.executable, "-c", _RUN, policy], env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        outcomes[policy] = json.loads(done.stdout.strip().splitlines()[-1])
    assert any((tmp_path / "inductor").iterdir())  # process 1 did leave its graph in the shared cache
    assert outcomes["default"]["compiled"] == outcomes["default"]["eager"] == ["torch.bfloat16", "torch.float32"]
    assert outcomes["edited"]["compiled"] == outcomes["edited"]["eager"] == ["torch.float32", "torch.bfloat16"]
    assert outcomes["default"]["close"] and outcomes["edited"]["close"]
