"""The private torch names ``src/`` uses: each distinct name, where it is used, and the totals issue 38 measures.

A private name is a dotted path from ``torch`` with a part that starts with an underscore (``torch._C._foo``,
``torch.utils._pytree``, also where the code names it in a string to look it up), or a private tensor attribute
(``._base``, ``._version``, ``._values()``). dynamo's, AOTAutograd's and inductor's internals
(``torch._dynamo``, ``torch._functorch``, ``torch._inductor``) are counted apart: issue 38's goal is at most 12
names, none of those, all in the shims (``_torch.py``, ``_compile_torch.py``, ``_torch_tensors.py``).

    python benchmarks/private_names.py            # the table and the totals
    python benchmarks/private_names.py --json     # the names and their places as JSON

tests/test_layout.py holds the totals to today's (33 names, 9 internals) so that they only go down.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import tokenize
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "ampkit"
SHIMS = ("_torch.py", "_compile_torch.py", "_torch_tensors.py")
INTERNALS = ("torch._dynamo", "torch._functorch", "torch._inductor")
_DOTTED = re.compile(r"\btorch(?:\.[A-Za-z_]\w*)*\.(?!__)_[A-Za-z]\w*(?:\.[A-Za-z_]\w*)*")
_ATTRIBUTE = re.compile(r"\.(_base|_version|_values)\b")


def find() -> dict[str, list[str]]:
    """Each private name with the ``file:line`` places that use it: in code, or as a whole string literal (a path
    to look up); comments, docstrings and prose strings left out. A module path is dropped where a longer name
    under it is found (``torch._dynamo.eval_frame`` looked up for its ``skip_code``: one name)."""
    found: dict[str, list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        lines = path.read_text().splitlines()
        paths: dict[int, list[str]] = {}  # line -> the whole-string paths on it
        with path.open() as source:
            for token in tokenize.generate_tokens(source.readline):
                if token.type not in (tokenize.STRING, tokenize.COMMENT):
                    continue
                if token.type == tokenize.STRING and not token.string.lstrip("rbRB").startswith(("f", "F")):
                    value = ast.literal_eval(token.string)
                    if isinstance(value, str) and _DOTTED.fullmatch(value):
                        paths.setdefault(token.start[0], []).append(value)
                (row, col), (end_row, end_col) = token.start, token.end
                for number in range(row, end_row + 1):  # blank the string or comment out of the code
                    start, end = (col if number == row else 0), (end_col if number == end_row else None)
                    line = lines[number - 1]
                    lines[number - 1] = line[:start] + " " * len(line[start:end]) + (line[end:] if end is not None else "")
        for number, code in enumerate(lines, 1):
            names = [m.group(0) for m in _DOTTED.finditer(code)] + [f"Tensor.{m.group(1)}" for m in _ATTRIBUTE.finditer(code)]
            for name in dict.fromkeys(names + paths.get(number, [])):
                found.setdefault(name, []).append(f"{path.relative_to(SRC)}:{number}")
    return {name: places for name, places in found.items() if not any(other.startswith(name + ".") for other in found)}


def summary(found: dict[str, list[str]]) -> dict[str, object]:
    outside = {name: [p for p in places if not p.startswith(SHIMS)] for name, places in found.items()}
    return {
        "names": len(found),
        "internals": sorted(n for n in found if n.startswith(INTERNALS)),
        "outside_the_shims": {n: places for n, places in outside.items() if places},
    }


def main() -> None:
    found = find()
    totals = summary(found)
    if "--json" in sys.argv:
        print(json.dumps({"found": found, **totals}, indent=1))
        return
    for name in sorted(found):
        places = found[name]
        print(f"{name:70s} {len(places):3d}  {', '.join(places[:3])}{' ...' if len(places) > 3 else ''}")
    print(f"\n{totals['names']} private names; {len(totals['internals'])} of dynamo, AOTAutograd or inductor; "
          f"{len(totals['outside_the_shims'])} used outside the shims (issue 38's goal: 12, 0 and 0). The shim's own "
          "table of what it checks on each torch (_torch._NEEDED, also names found through getattr): "
          f"{_shim_table()} entries.")


def _shim_table() -> int:
    sys.path.insert(0, str(SRC.parent))
    from ampkit import _torch

    return len(_torch._NEEDED)


if __name__ == "__main__":
    main()
