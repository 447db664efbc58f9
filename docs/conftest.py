"""Every Python code block of the guides in docs/ runs as a test (sybil reads Markdown fences)."""

from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

pytest_collect_file = Sybil(parsers=[PythonCodeBlockParser(), SkipParser()], patterns=["*.md"]).pytest()
