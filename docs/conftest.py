"""Every Python code block of the guides in docs/ runs as a test (sybil reads Markdown fences),
and a ``text`` block right after a Python block must be what that block printed (lines compared
without trailing spaces; ``...`` in the page stands for any text, as doctest's ELLIPSIS)."""

from __future__ import annotations

import contextlib
import io
import re

from sybil import Example, Sybil
from sybil.evaluators.python import PythonEvaluator
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser


class _Printing:
    """Runs a Python block, keeping what it printed and where it ends for the block after it."""

    def __init__(self) -> None:
        self.run = PythonEvaluator()

    def __call__(self, example: Example) -> None:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            self.run(example)
        example.namespace["__printed__"] = (example.end, out.getvalue())


def _lines(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def _check_output(example: Example) -> str | None:
    end, printed = example.namespace.get("__printed__", (None, ""))
    if end is None or example.document.text[end:example.start].strip():
        return None  # a text block not right after a Python block is prose, not output
    want, got = _lines(str(example.parsed)), _lines(printed)
    pattern = ".*?".join(re.escape(part) for part in want.split("..."))
    if re.fullmatch(pattern, got, flags=re.DOTALL) is None:
        return f"the Python block above printed:\n{got}\n\nbut the page shows:\n{want}"
    return None


class _PythonBlocks(PythonCodeBlockParser):
    """Python blocks (``>>>`` ones as doctests), each keeping what it printed."""

    def __init__(self) -> None:
        super().__init__()
        self.codeblock_parser = CodeBlockParser("python", _Printing())


pytest_collect_file = Sybil(parsers=[_PythonBlocks(),
                                     CodeBlockParser("text", _check_output), SkipParser()],
                            patterns=["*.md"]).pytest()
