"""Constrained decoding with llguidance: a request's grammar (from a JSON schema, a regex or
a Lark grammar; ``SamplingParams.grammar``) gets a matcher per sequence, which gives the
tokens allowed next as a bitmask and consumes each sampled token.

A step's masks are filled on the host while its forward runs on the device (the engine
builds them after queuing the forward), copied to the device and applied to the logits
before the draw (``logits.BatchSampling``). The mask of step n+1 needs step n's token, so a
batch with a constrained row is never decoded a step ahead (engine look-ahead).

llguidance is the grammar engine (a maintained Rust library: Earley parsing over a lexer);
nothing here parses grammars.
"""
from __future__ import annotations

import threading

import torch


def json_schema_grammar(schema: dict | str) -> str:
    """The grammar of JSON text matching ``schema`` (``{"type": "object"}`` for any object)."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(schema)


def _one_line(error: str) -> str:
    """llguidance's error in one line. A regex's parser gives its reason on an ``error:``
    line, between a copy of the regex and the wrapping grammar's text, which the client never
    wrote: only that line."""
    reason = [line.removeprefix("error: ") for line in error.splitlines() if line.startswith("error: ")]
    return reason[0] if reason else " ".join(error.split())


class GrammarError(ValueError):
    """A grammar llguidance cannot compile: the message is its whole error, ``reason`` one line."""

    def __init__(self, error: str):
        super().__init__(f"invalid grammar: {error}")
        self.reason = _one_line(error)


def json_schema_error(schema: dict) -> str | None:
    """Why llguidance cannot enforce ``schema``, in one line (None: it can). No tokenizer needed."""
    import llguidance

    return _one_line(llguidance.LLMatcher.validate_grammar(json_schema_grammar(schema))) or None


def regex_grammar(regex: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_regex(regex)


def lark_grammar(lark: str) -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(lark)


class GrammarMatchers:
    """Matchers for one model's tokenizer. The llguidance tokenizer (an index over the whole
    vocabulary, slow to build) is made on the first constrained request."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]):
        self.hf_tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, sorted(eos_token_ids)
        self._tokenizer = self._executor = None
        self._lock = threading.Lock()

    def _ll_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                               eos_token=self.eos or None)
            return self._tokenizer

    def matcher(self, grammar: str):
        """A fresh matcher of ``grammar``; GrammarError (with llguidance's message) if invalid."""
        import llguidance

        m = llguidance.LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
        if m.is_error():
            raise GrammarError(m.get_error())
        return m

    def masks(self, matchers: list) -> torch.Tensor:
        """``[B, words]`` int32 bitmasks (bit t of word w: token 32 w + t allowed); a row whose
        matcher is None allows every token. The rows are filled in parallel by llguidance's
        thread pool, without the GIL."""
        import llguidance
        import llguidance.torch

        mask = torch.full((len(matchers), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        llguidance.torch.fill_next_token_bitmask_par(self._executor, rows, mask)
        return mask


def apply_masks(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[B, V]`` with the tokens ``mask`` (``[B, words]``, on the logits' device)
    disallows at -inf."""
    bits = torch.arange(32, dtype=torch.int32, device=mask.device)
    allowed = ((mask[:, :, None] >> bits) & 1).view(mask.shape[0], -1)[:, : logits.shape[1]].bool()
    return logits.masked_fill(~allowed, float("-inf"))
