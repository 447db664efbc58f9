"""``docs/design.md``'s table of interception sites is the code's: every place zfunc attaches to
torch (hooks, autograd Functions, saved-tensor hooks, autograd callbacks, tensor subclasses,
context variables, finalizers, weak references with a meaning), keeps process-wide mutable state,
writes a tensor's storage, a module's entries or torch's hook tables, or reads torch's private
state, counted per file and kind by scanning the package. The test fails when the table and the
code disagree."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import zfunc

ROOT = Path(zfunc.__file__).parent
DESIGN = ROOT.parent / "docs" / "design.md"
KINDS = {
    "hook": r"register_[a-z_]*hook[a-z_]*\s*\(",
    "autograd Function": r"autograd\.Function\)",
    "saved-tensor hooks": r"saved_tensors_hooks\s*\(",
    "autograd callback": r"queue_callback\s*\(",
    "tensor subclass": r"def __torch_(dispatch|function)__",
    "context variable": r"ContextVar\s*\(",
    "finalizer": r"weakref\.finalize\s*\(",
    "weak reference": r"^\s+.*(Weak(Set|KeyDictionary|ValueDictionary)\s*\(|weakref\.ref\(\w+,\s*(lambda|functools))",
    "tensor writer": r"\.data = |swap_tensors\(|entries\[key\] = |_forward_(pre_)?hooks(_always_called)?(\[|\.pop\()",
    "private read": r"torch\._C\._|torch\._functorch\.",
}
_MUTATE = r"\b{0}(\[[^\]]*\]\s*=(?!=)|\.(add|append|update|pop|clear|setdefault|discard|remove|extend)\()|del {0}\["


def scan() -> collections.Counter:
    """``(file, kind) -> sites`` in the package (the ``deepspeed`` package the switch serves is
    names only); module-level state is ``global NAME``: a name rebound under ``global``, or a
    module-level container that the module mutates."""
    out: collections.Counter = collections.Counter()
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).as_posix()
        if "deepspeed_path" in rel:
            continue
        text = path.read_text()
        for line in text.splitlines():
            if line.strip().startswith(("#", ">>>", "...")):
                continue
            for kind, rx in KINDS.items():
                if re.search(rx, line):
                    out[(rel, kind)] += 1
        names = {n.strip() for g in re.findall(r"^\s+global ([\w, ]+)$", text, re.M) for n in g.split(",")}
        for m in re.finditer(r"^(_?[A-Za-z]\w*)\s*(?::[^=\n]+)?=\s*(\{|\[|set\(|dict\(|weakref\.)", text, re.M):
            if re.search(_MUTATE.format(m.group(1)), text):
                names.add(m.group(1))
        for name in names:
            out[(rel, f"global {name}")] += 1
    return out


def table() -> collections.Counter:
    """The rows of design.md's "Interception sites" table: ``| file | kind | sites | why |``."""
    section = DESIGN.read_text().split("## Interception sites", 1)[1].split("\n## ", 1)[0]
    out: collections.Counter = collections.Counter()
    for row in re.findall(r"^\| `([^`]+)` \| ([^|]+?) \| (\d+) \|", section, re.M):
        out[(row[0], row[1].strip().strip("`"))] += int(row[2])
    return out


def test_the_design_table_lists_every_interception_site():
    code, doc = scan(), table()
    missing = sorted(f"{f}: {k} x{n - doc.get((f, k), 0)}" for (f, k), n in code.items() if n > doc.get((f, k), 0))
    extra = sorted(f"{f}: {k} x{n - code.get((f, k), 0)}" for (f, k), n in doc.items() if n > code.get((f, k), 0))
    assert not missing and not extra, f"in the code, not in docs/design.md: {missing}; in the table only: {extra}"
    stated = re.search(r"There are (\d+) today", DESIGN.read_text())
    assert stated and int(stated.group(1)) == sum(code.values()), (
        f"docs/design.md says {stated and stated.group(1)} sites; the code has {sum(code.values())}")


def test_the_scan_finds_each_kind():
    """The scanner itself: each pattern finds what it names (a broken pattern would pass above)."""
    sample = {
        "hook": "    m.register_forward_pre_hook(f)",
        "autograd Function": "class F(VmapAsIs, torch.autograd.Function):",
        "saved-tensor hooks": "    return torch.autograd.graph.saved_tensors_hooks(a, b)",
        "autograd callback": "    engine.queue_callback(f)",
        "tensor subclass": "    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):",
        "context variable": "X = contextvars.ContextVar('x')",
        "finalizer": "    weakref.finalize(self, f)",
        "weak reference": "        self._pending = weakref.WeakSet()",
        "tensor writer": "            p.data = torch.empty(0)",
        "tensor writer ": "            mod._forward_hooks.pop(key, None)",
        "private read": "    return torch._C._current_graph_task_id()",
    }
    for kind, line in sample.items():
        assert re.search(KINDS[kind.strip()], line), kind
    assert sum(n for (_, k), n in scan().items() if k.startswith("global ")) > 0
