"""The packages of zfunc form layers: no import cycle between packages at import time, and the
training core imports neither the DeepSpeed shim (``compat``) nor checkpoint I/O (``io``)."""

from __future__ import annotations

import ast
import collections
from pathlib import Path

import zfunc

ROOT = Path(zfunc.__file__).parent
# The layers, bottom first: a package may import the ones below it only.
ORDER = ["errors", "_tree", "_probes", "distributed", "autograd", "core", "io", "compat", "tools"]


def _imports() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Package -> packages it imports when imported (``top``) and inside functions (``lazy``);
    imports under ``TYPE_CHECKING`` are annotations only and left out."""
    top: dict[str, set[str]] = collections.defaultdict(set)
    lazy: dict[str, set[str]] = collections.defaultdict(set)

    def package(module: str) -> str:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else ""

    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent)
        if "deepspeed_path" in rel.parts or rel.parts[1] == "__init__.py":
            continue
        me = package(".".join(rel.with_suffix("").parts))

        def walk(node: ast.AST, at_top: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    continue
                if isinstance(child, ast.ImportFrom) and child.module:
                    names = [child.module] if child.module != "zfunc" else [f"zfunc.{a.name}" for a in child.names]
                elif isinstance(child, ast.Import):
                    names = [a.name for a in child.names]
                else:
                    names = []
                for name in names:
                    if name.startswith("zfunc.") and package(name) != me:
                        (top if at_top else lazy)[me].add(package(name))
                walk(child, at_top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

        walk(ast.parse(path.read_text()), True)
    return top, lazy


def test_packages_import_only_the_layers_below_them():
    top, _ = _imports()
    rank = {p: i for i, p in enumerate(ORDER)}
    upward = sorted(f"{a} -> {b}" for a, bs in top.items() for b in bs
                    if a in rank and b in rank and rank[b] >= rank[a])
    assert not upward, f"imports against the layers {ORDER}: {upward}"


def test_core_imports_neither_compat_nor_io():
    top, lazy = _imports()
    assert not (top["core"] | lazy["core"]) & {"compat", "io"}, (top["core"], lazy["core"])
