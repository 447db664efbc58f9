"""Every public name has a runnable example, and importing zfunc emits no warnings."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

import zfunc
import zfunc_kernels


def _public():
    for mod in (zfunc, zfunc_kernels):
        for name in mod.__all__:
            obj = getattr(mod, name)
            yield f"{mod.__name__}.{name}", obj


@pytest.mark.parametrize("qualname,obj", list(_public()), ids=[q for q, _ in _public()])
def test_public_name_has_a_doctest_example(qualname, obj):
    doc = inspect.getdoc(obj) or ""
    if qualname == "zfunc.tree":  # optree's own functions, documented by optree
        doc = inspect.getdoc(sys.modules["zfunc._tree"]) or ""
    elif inspect.ismodule(obj):  # a public submodule: each of its public functions needs one
        names = getattr(obj, "__all__", [])
        missing = [n for n in names if callable(getattr(obj, n)) and ">>>" not in (inspect.getdoc(getattr(obj, n)) or "")
                   and not isinstance(getattr(obj, n), type)]
        assert not missing, f"{qualname}: {missing} have no >>> example"
        return
    assert ">>>" in doc, f"{qualname} has no >>> example in its docstring"


def test_import_emits_no_warnings():
    code = "import zfunc, zfunc_kernels, zfunc.models, zfunc.tools.metrics"
    proc = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def _resolve(dotted: str):
    """The object a dotted ``zfunc...`` name denotes (importing submodules as needed)."""
    import importlib

    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


def test_every_backticked_zfunc_name_in_the_docs_exists():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    files = [*sorted((root / "docs").glob("*.md")), root / "README.md"]
    pattern = re.compile(r"`((?:zfunc|zfunc_kernels)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
    missing = []
    for f in files:
        for name in sorted(set(pattern.findall(f.read_text()))):
            try:
                _resolve(name)
            except (ImportError, AttributeError):
                missing.append(f"{f.name}: {name}")
    assert not missing, missing


def test_the_reliability_table_points_at_tests_that_exist():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    text = (root / "docs" / "reliability.md").read_text()
    refs = re.findall(r"`(test_\w+\.py)::(\w+)`", text)
    short = re.findall(r"`::(test_\w+)`", text)
    assert len(refs) >= 15
    for module, name in refs:
        source = (root / "tests" / module).read_text()
        assert f"def {name}(" in source, f"{module}::{name}"
    for name in short:
        assert any(f"def {name}(" in p.read_text() for p in (root / "tests").glob("test_*.py")), name


_ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
_PAGES = sorted([*_ROOT.glob("*.md"), *(_ROOT / "docs").glob("*.md"), *(_ROOT / "benchmarks").glob("*.md")])
_TOP = ("benchmarks", "docs", "zfunc", "zfunc_kernels", "tests", "examples", "scripts")
_PATH = __import__("re").compile(r"`((?:%s)/[\w./-]*\w)`" % "|".join(_TOP))
_LINK = __import__("re").compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("page", _PAGES, ids=[str(p.relative_to(_ROOT)) for p in _PAGES])
def test_every_file_a_page_names_exists(page):
    """A path in backticks (`benchmarks/overhead.py`) is relative to the repository; a link
    ([text](other.md), ![plot](e2e.png)) relative to the page."""
    text = page.read_text()
    missing = [p for p in _PATH.findall(text) if not (_ROOT / p).exists()]
    missing += [link for link in _LINK.findall(text)
                if "://" not in link and not link.startswith("mailto:") and not (page.parent / link).exists()]
    assert not missing, f"{page.relative_to(_ROOT)} names files that do not exist: {missing}"


def _engine_table(kind: str) -> list[str]:
    text = (_ROOT / "docs" / "deepspeed.md").read_text()
    table = text[text.index(f"| {kind} | methods |"):]
    rows = table[:table.index("\n\n")].splitlines()[2:]
    return [n for row in rows for n in __import__("re").findall(r"`(\w+)`", row.split("|")[2])]


def test_the_engine_method_tables_say_what_the_engine_has():
    """docs/deepspeed.md lists DeepSpeedEngine's 175 public methods: the provided ones exist on
    zfunc.Engine and the absent ones do not (adding one means moving its name)."""
    provided, absent = _engine_table("provided"), _engine_table("absent")
    assert len(provided) == 43 and len(provided) + len(absent) == 175 and not set(provided) & set(absent)
    assert [n for n in provided if not hasattr(zfunc.Engine, n)] == []
    assert [n for n in absent if hasattr(zfunc.Engine, n)] == []
