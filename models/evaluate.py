"""Perplexity on a text file (wikitext-2 by default), through whatever path the model runs.

Protocol: tokenize the text, cut the token stream into non-overlapping windows of
``seq_len`` tokens, score each window independently (no context across windows), and
report exp(mean next-token negative log-likelihood) over the first ``windows`` windows
(40 x 512 tokens by default; all of them with ``windows=None``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .progress import progress as progress_of

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "wikitext-2" / "test.txt"  # (shipped: data/wikitext-2/README.md)


@dataclass
class PerplexityResult:
    perplexity: float
    nll: float
    tokens: int
    windows: int
    seq_len: int


def token_stream(tokenizer, text: str, needed: int | None) -> torch.Tensor:
    """Token ids of ``text`` (only a prefix of the text when ``needed`` tokens suffice:
    tokenizing 1.3 MB to score 20k tokens would dominate a CPU run)."""
    if needed is not None:
        chars = max(8 * needed, 4096)
        while chars < len(text):
            ids = tokenizer(text[:chars], add_special_tokens=False)["input_ids"]
            if len(ids) > needed + 16:  # the last tokens near the cut may differ: keep a margin
                return torch.tensor(ids[:needed])
            chars *= 2
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])


@torch.inference_mode()
def perplexity(model, tokenizer, text: str, seq_len: int = 512, windows: int | None = 40,
               progress: bool = True) -> PerplexityResult:
    ids = token_stream(tokenizer, text, None if windows is None else windows * seq_len)
    n = ids.numel() // seq_len
    n = n if windows is None else min(n, windows)
    if n < 1:
        raise ValueError(f"the text has fewer than {seq_len} tokens")
    total, count = 0.0, 0
    for w in progress_of(range(n), "perplexity", progress):
        chunk = ids[w * seq_len : (w + 1) * seq_len].to(model.device)[None]
        logits = model(chunk)[0, :-1].float()
        total += F.cross_entropy(logits, chunk[0, 1:], reduction="sum").item()
        count += seq_len - 1
    nll = total / count
    return PerplexityResult(math.exp(nll), nll, count, n, seq_len)
