"""Character-level text from Python's own documentation (``pydoc_data``): no downloads."""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["CharCorpus"]


@dataclasses.dataclass(frozen=True)
class CharCorpus:
    """A text as one token tensor, with its character vocabulary.

    Examples:
        >>> from zfunc.models import CharCorpus
        >>> corpus = CharCorpus.from_text("hello world")
        >>> corpus.vocab_size, corpus.decode(corpus.tokens[:5])
        (8, 'hello')
    """

    tokens: torch.Tensor
    chars: str

    @classmethod
    def from_text(cls, text: str) -> CharCorpus:
        chars = "".join(sorted(set(text)))
        index = {c: i for i, c in enumerate(chars)}
        return cls(tokens=torch.tensor([index[c] for c in text], dtype=torch.long), chars=chars)

    @classmethod
    def python_docs(cls, max_chars: int | None = None) -> CharCorpus:
        """The help topics that ship with CPython (about 460k characters of English prose)."""
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in sorted(topics))
        text = "".join(c for c in text if c.isascii())
        return cls.from_text(text[:max_chars] if max_chars else text)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def decode(self, tokens: torch.Tensor) -> str:
        return "".join(self.chars[int(t)] for t in tokens)

    def batch(self, batch_size: int, block_size: int, *, seed: int, step: int, rank: int = 0) -> dict[str, torch.Tensor]:
        """``batch_size`` random windows, a pure function of ``(seed, step, rank)``.

        Returns ``{"x": tokens, "y": the tokens one place later}``, both ``(batch, block)``.
        """
        g = torch.Generator().manual_seed(hash((seed, step, rank)) & 0x7FFF_FFFF)
        starts = torch.randint(0, len(self.tokens) - block_size - 1, (batch_size,), generator=g)
        idx = starts[:, None] + torch.arange(block_size + 1)
        windows = self.tokens[idx]
        return {"x": windows[:, :-1], "y": windows[:, 1:]}
