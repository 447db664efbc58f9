"""Small models and data that ship with zfunc, for the main job, examples and benchmarks."""

from __future__ import annotations

from zfunc.models.gpt import GPT as GPT
from zfunc.models.gpt import GPTConfig as GPTConfig
from zfunc.models.gpt import lm_loss as lm_loss
from zfunc.models.text import CharCorpus as CharCorpus

__all__ = ["GPT", "GPTConfig", "CharCorpus", "lm_loss"]
