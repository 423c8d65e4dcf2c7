"""One step's sampling for a batch on the device: the rows' parameters as tensors, the
logit processors (logit bias, min_tokens, presence / frequency / repetition penalties), the
draw (``sampling.sample_some``) and the log-probabilities a request asked for.

Everything a step needs is built on the host once per launch (``BatchSampling.of``) and
reused, one token further, by a look-ahead step (``BatchSampling.next``), so that no value
is read back from the device between two steps. Penalties count a sequence's generated
tokens from ``TokenHistory`` (each step writes its sampled ids there on the device, at the
index of the token in its sequence): a look-ahead step that the engine drops leaves ids
that the step relaunched in its place overwrites, so the counts never see a dropped token.

Order, as vLLM applies them: logit bias, min_tokens, the penalties, then a grammar's mask
(``grammar.py``), on the raw logits; then temperature, top-k / top-p and the draw.
Log-probabilities are the model's own (the raw logits' log-softmax, before any processing),
as vLLM returns by default.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..kernels.device import to_device
from .grammar import apply_masks
from .sampling import SamplingParams, greedy, sample_some

class TokenHistory:
    """Each sequence row's generated token ids on the device (``[slots, max_len]``), and the
    vocabulary its prompt holds (``[slots, vocab]`` bool, for the repetition penalty).
    Allocated when a request first needs it."""

    def __init__(self, slots: int, max_len: int, vocab: int, device: torch.device):
        self.ids = torch.zeros(slots, max_len, dtype=torch.long, device=device)
        self.prompt = torch.zeros(slots, vocab, dtype=torch.bool, device=device)

    def start(self, slot: int, prompt_ids: list[int]) -> None:
        """A sequence takes ``slot``: its prompt's tokens are what the repetition penalty
        also counts."""
        self.prompt[slot].zero_()
        self.prompt[slot, torch.tensor(prompt_ids, device=self.prompt.device)] = True

    def resume(self, slot: int, prompt_ids: list[int], generated: list[int]) -> None:
        """A preempted sequence resumes in ``slot``: its prompt and the ids it had generated."""
        self.start(slot, prompt_ids)
        self.ids[slot, :len(generated)] = torch.tensor(generated, device=self.ids.device)

    def counts(self, slots: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """``[B, vocab]`` int32: each row's generated tokens before index ``steps``."""
        ids = self.ids[slots]
        valid = torch.arange(ids.shape[1], device=ids.device)[None, :] < steps[:, None]
        out = torch.zeros(len(slots), self.prompt.shape[1], dtype=torch.int32, device=ids.device)
        return out.scatter_add_(1, ids, valid.to(torch.int32))


@dataclass(frozen=True)
class Processors:
    """The processed rows' parameters (only present where some row of the batch asks)."""

    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, values)
    banned: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, min_tokens of the row)
    penalties: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # presence, frequency, repetition [B]
    mask: torch.Tensor | None = None  # [B, words] int32: the grammars' allowed tokens (GrammarMatchers.masks)


@dataclass(frozen=True)
class BatchSampling:
    """A decode step's per-row sampling, on the device."""

    temperature: torch.Tensor  # [B] fp32
    top_k: torch.Tensor  # [B] int64
    top_p: torch.Tensor  # [B] fp32
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64: the index of the token drawn now in its sequence
    slots: torch.Tensor  # [B] int64: the rows' KV slots (their TokenHistory rows)
    all_greedy: bool
    processors: Processors | None
    logprobs: int | None  # top log-probabilities to return (the largest any row asks); None: none
    min_p: torch.Tensor | None = None  # [B] fp32; None: no row asks for min-p

    @staticmethod
    def of(params: list[SamplingParams], seeds: list[int], steps: list[int], slots: list[int],
           eos: set[int], device: torch.device, mask: torch.Tensor | None = None) -> "BatchSampling":
        """``mask``: the rows' grammar masks on the host (``GrammarMatchers.masks``), where a
        row has a grammar."""
        def t(values, dtype=None):
            return to_device(torch.tensor(values, dtype=dtype), device)  # (queued: a step may be queued ahead)

        processors = None
        if any(p.processed for p in params):
            bias = [(i, tok, v) for i, p in enumerate(params) for tok, v in p.logit_bias]
            banned = [(i, tok, p.min_tokens) for i, p in enumerate(params) if p.min_tokens
                      for tok in sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else eos))]
            penalized = any(p.penalized for p in params)
            processors = Processors(
                bias=(t([r for r, _, _ in bias], torch.long), t([k for _, k, _ in bias], torch.long),
                      t([v for _, _, v in bias], torch.float32)) if bias else None,
                banned=tuple(t(list(c), torch.long) for c in zip(*banned)) if banned else None,
                penalties=(t([p.presence_penalty for p in params], torch.float32),
                           t([p.frequency_penalty for p in params], torch.float32),
                           t([p.repetition_penalty for p in params], torch.float32)) if penalized else None,
                mask=None if mask is None else to_device(mask, device))
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        return BatchSampling(
            t([p.temperature for p in params], torch.float32), t([p.top_k for p in params], torch.long),
            t([p.top_p for p in params], torch.float32), t(seeds, torch.long), t(steps, torch.long),
            t(slots, torch.long), all(p.greedy for p in params), processors, max(wanted) if wanted else None,
            t([p.min_p for p in params], torch.float32) if any(p.min_p for p in params) else None)

    def next(self) -> "BatchSampling":
        """The same rows' sampling one token further (a look-ahead step)."""
        return replace(self, steps=self.steps + 1)

    @property
    def needs_history(self) -> bool:
        return self.processors is not None and self.processors.penalties is not None

    def process(self, logits: torch.Tensor, history: TokenHistory | None) -> torch.Tensor:
        """The logits after the rows' logit bias, min_tokens bans, penalties and grammar
        masks (fp32)."""
        p = self.processors
        if p is None:
            return logits
        logits = logits.float().clone()
        if p.bias is not None:
            rows, toks, values = p.bias
            logits.index_put_((rows, toks), values, accumulate=True)
        if p.banned is not None:
            rows, toks, mins = p.banned
            still = self.steps[rows] < mins
            logits[rows, toks] = torch.where(still, float("-inf"), logits[rows, toks])
        if p.penalties is not None:
            presence, frequency, repetition = p.penalties
            counts = history.counts(self.slots, self.steps)
            seen = counts > 0
            # repetition (CTRL, as HF and vLLM): a seen token's logit divided by the penalty
            # when positive, multiplied when negative; "seen": in the prompt or generated
            rep = repetition[:, None]
            hit = seen | history.prompt[self.slots]
            logits = torch.where(hit, torch.where(logits > 0, logits / rep, logits * rep), logits)
            logits -= frequency[:, None] * counts + presence[:, None] * seen
        if p.mask is not None:
            logits = apply_masks(logits, p.mask)
        return logits

    def draw(self, logits: torch.Tensor, history: TokenHistory | None) -> tuple[torch.Tensor, "Logprobs | None"]:
        """The rows' next ids ``[B]`` and, where asked, their log-probabilities."""
        processed = self.process(logits, history)
        if self.all_greedy:
            tokens = greedy(processed)
        else:
            tokens = sample_some(processed, self.temperature, self.top_k, self.top_p, self.seeds, self.steps,
                                 self.min_p)
        if history is not None:
            history.ids[self.slots, self.steps] = tokens
        return tokens, (Logprobs.of(logits, tokens, self.logprobs) if self.logprobs is not None else None)


@dataclass(frozen=True)
class Logprobs:
    """A step's log-probabilities on the device: the drawn token's ``[B]`` and the top ``k``
    ``[B, k]`` (values, ids), from the model's log-softmax in fp32."""

    chosen: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor

    @staticmethod
    def of(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> "Logprobs":
        logp = torch.log_softmax(logits.float(), dim=-1)
        values, ids = logp.topk(k, dim=-1)
        return Logprobs(logp.gather(1, tokens[:, None]).squeeze(1), values, ids)

    def to_host(self) -> "Logprobs":
        """Pinned host copies, queued (read them after the step's ``ready`` event)."""
        def pinned(x):
            h = torch.empty(x.shape, dtype=x.dtype, pin_memory=x.is_cuda)
            h.copy_(x, non_blocking=x.is_cuda)
            return h

        return Logprobs(pinned(self.chosen), pinned(self.top_values), pinned(self.top_ids))

    def row(self, i: int, k: int, token: int) -> "TokenLogprob":
        """Row ``i``'s: its drawn ``token``'s and its top ``k``."""
        return TokenLogprob(token, float(self.chosen[i]),
                            list(zip(self.top_ids[i, :k].tolist(), self.top_values[i, :k].tolist())))


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token (id), its log-probability and the ``top_logprobs`` most likely
    tokens (id, log-probability), most likely first."""

    token: int
    logprob: float
    top: list[tuple[int, float]]
