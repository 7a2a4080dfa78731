"""The private torch names ``src/`` uses: each distinct name, where it is used, and the totals issue 38 measures.

A private name is a dotted path from ``torch`` (or ``nn``, ``F``) with a part that starts with an underscore
(``torch._C._foo``, ``torch.utils._pytree``, also where the code names it in a string to look it up), a private
tensor attribute (``._base``, ``._version``, ``._values()``), or any other attribute that starts with one and that
ampkit does not define, read as ``x._name`` or looked up by its string (``getattr(ctx, "_fwd_used_autocast")``):
torch's (``._orig_mod``, ``._saved_self``), less ATen operator names (``"_to_copy"``: the dispatcher's names of ops,
which torch's own checkpoint policies list) and the other libraries' names below (``NOT_TORCH``). dynamo's, AOTAutograd's and inductor's internals
(``torch._dynamo``, ``torch._functorch``, ``torch._inductor``) are counted apart: issue 38's goal is at most 12
names, none of those, all in the shims (``_torch.py``, ``_torch_tensors.py``).

    python benchmarks/private_names.py            # the table and the totals
    python benchmarks/private_names.py --json     # the names and their places as JSON

tests/test_layout.py holds the totals to today's (29 names, 5 internals) so that they only go down.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import tokenize
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "ampkit"
SHIMS = ("_torch.py", "_torch_tensors.py")
INTERNALS = ("torch._dynamo", "torch._functorch", "torch._inductor")
_DOTTED = re.compile(r"\b(?:torch|nn|F)(?:\.[A-Za-z_]\w*)*\.(?!__)_[A-Za-z]\w*(?:\.[A-Za-z_]\w*)*")
_ATTRIBUTE = re.compile(r"\.(_base|_version|_values)\b")
# Private names of Python's and of other libraries that src/ reads: not torch's.
NOT_TORCH = {
    "_getframe": "sys", "_current_frames": "sys", "_wait_for_tstate_lock": "threading",
    "_worker": "concurrent.futures.thread", "_SubParsersAction": "argparse", "_fields": "collections.namedtuple",
    "_after_closure": "Lightning's precision plugin", "_current_fx_name": "Lightning's LightningModule",
    "_optimizer": "Lightning's LightningOptimizer", "_optimizers": "Accelerate's Accelerator",
}


def find() -> dict[str, list[str]]:
    """Each private name with the ``file:line`` places that use it: in code, or as a whole string literal (a path
    to look up); comments, docstrings and prose strings left out. A module path is dropped where a longer name
    under it is found (``torch._dynamo.eval_frame`` looked up for its ``OptimizedModule``: one name)."""
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
    found = {name: places for name, places in found.items() if not any(other.startswith(name + ".") for other in found)}
    for name, places in _foreign_attributes(found).items():
        found.setdefault(f"._{name}", []).extend(places)
    return found


def _foreign_attributes(found: dict[str, list[str]]) -> dict[str, list[str]]:
    """Attributes starting with one underscore that src/ reads (``x._name``, or ``"_name"`` looked up) and defines
    nowhere (no def, class, argument or assignment of that name), that are not a part of a name found above, an
    ATen operator's name or ``NOT_TORCH``: torch's privates reached through an object. Keyed without the underscore."""
    import torch

    defined: set[str] = set()
    used: dict[str, list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, ast.arg):
                defined.add(node.arg)
            elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
                defined.add(node.id if isinstance(node, ast.Name) else node.attr)
            for name, line in _looked_up(node):
                if name.isidentifier() and name.startswith("_") and not name.startswith("__"):
                    used.setdefault(name, []).append(f"{path.relative_to(SRC)}:{line}")
    parts = {part for name in found for part in name.split(".")}
    return {name[1:]: places for name, places in used.items()
            if name not in defined | parts | NOT_TORCH.keys() and not hasattr(torch.ops.aten, name)}


def _looked_up(node: ast.AST) -> list[tuple[str, int]]:
    """The attribute names ``node`` reads: ``x.name``, ``getattr(x, "name")`` (hasattr, setattr too), and the
    strings of a module-level tuple or list of names (looked up in a loop)."""
    if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
        return [(node.attr, node.lineno)]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")):
        strings = [node.args[1]]
    elif isinstance(node, ast.Module):
        strings = [element for statement in node.body if isinstance(statement, ast.Assign)
                   and isinstance(statement.value, (ast.Tuple, ast.List)) for element in statement.value.elts]
    else:
        return []
    return [(s.value, s.lineno) for s in strings if isinstance(s, ast.Constant) and isinstance(s.value, str)]


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
