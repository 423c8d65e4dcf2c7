"""Per-request sampling for a whole batch in one pass (greedy, temperature, min-p, top-k,
top-p, seed).

Random draws come from a counter-based hash of (request seed, step, token id) rather than
from a stateful generator: a request's tokens then depend only on its own seed and
logits, never on which other requests share its batch, and the whole batch samples in a
handful of tensor ops on whatever device the logits live (only the chosen ids move to
the host). Sampling is exact: Gumbel-max over the temperature-scaled, min-p/top-k/top-p
filtered logits draws from their softmax.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int = 0  # 0 = no top-k
    min_p: float = 0.0  # in [0, 1]: keep tokens at least this times as likely as the most likely; 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    include_stop_str: bool = False  # the stop string found ends the text rather than being cut
    ignore_eos: bool = False
    # Log-probabilities (engine/logits.py): None none; k: the drawn token's and the top k.
    logprobs: int | None = None
    # Logit processors, applied to the raw logits before temperature (engine/logits.py).
    presence_penalty: float = 0.0  # minus this once for a token generated before
    frequency_penalty: float = 0.0  # minus this per time a token was generated before
    repetition_penalty: float = 1.0  # CTRL's, over prompt and generated tokens; 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # end-of-sequence and stop_token_ids banned before this many tokens
    stop_token_ids: tuple[int, ...] = ()  # end the request (not part of the text)
    grammar: str | None = None  # constrained decoding: an llguidance grammar (engine/grammar.py)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError("logprobs must be in [0, 20]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def processed(self) -> bool:
        """Whether a logit processor changes this request's logits."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0 or self.grammar is not None


def _signed(x: int) -> int:
    """A 64-bit constant as the signed int64 torch stores (arithmetic wraps mod 2**64)."""
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_STEP = _signed(0xD1B54A32D192ED03)
_TOKEN = _signed(0xAEF17502108EF2D9)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[B, vocab]`` fp32 uniforms in (0, 1), a pure function of (seed, step, token id).

    splitmix64's finaliser over a linear combination of the three counters.
    """
    tok = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    z = seeds[:, None] * _GOLDEN + steps[:, None] * _STEP + tok[None, :] * _TOKEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    return unit_interval(_shr(z, 41))


def unit_interval(bits: torch.Tensor) -> torch.Tensor:
    """23-bit integers ``[0, 2**23)`` as fp32 in (0, 1): ``(bits + 0.5) / 2**23``, exact in fp32
    (24 significant bits), so never 0 nor 1. (With 24 bits the top value, 1 - 2**-25, rounds
    to 1.0 in fp32: its Gumbel noise is +inf, and that token wins whatever its logit, -inf
    from a grammar's mask included.)"""
    return (bits.float() + 0.5) * (1.0 / (1 << 23))


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)``; on CUDA spread over the GPU (``kernels/argmax.py``)."""
    if logits.is_cuda and logits.dim() == 2 and logits.stride(-1) == 1:
        from ..kernels.argmax import argmax_rows

        return argmax_rows(logits)
    return logits.argmax(-1)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next token ids ``[B]`` (int64) from fp32 ``logits`` ``[B, V]`` and per-row parameters
    (``min_p`` None: no row asks for min-p)."""
    if bool(((temperature == 0) | (top_k == 1)).all()):
        return greedy(logits)
    return sample_some(logits, temperature, top_k, top_p, seeds, steps, min_p)


def sample_some(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sample`` for a batch known (on the host) to have at least one sampled row: no
    look at the device values, so nothing waits for the GPU (the engine queues the next
    decode step before this step's tokens are read)."""
    logits = logits.float()
    is_greedy = (temperature == 0) | (top_k == 1)
    B, V = logits.shape
    scaled = logits / temperature.clamp(min=1e-5)[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, V)[:, None]
    drop = rank >= k
    if min_p is not None:
        # min-p first, as vLLM orders it (top-p then measures what is left): a token stays while
        # p >= min_p * p_max, i.e. its scaled logit >= the largest + log(min_p) (log 0 = -inf: all stay)
        drop |= sorted_logits < sorted_logits[:, :1] + min_p.log()[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    drop |= (mass_before >= top_p[:, None]) & (rank > 0)  # keep the smallest set reaching top_p
    filtered = sorted_logits.masked_fill(drop, float("-inf"))
    # Noise belongs to token ids (not sorted ranks), so ties in the sort cannot change a draw.
    gumbel = -torch.log(-torch.log(uniform_noise(seeds, steps, V)))
    choice = (filtered + gumbel.gather(1, order)).argmax(-1)
    sampled = order.gather(1, choice[:, None]).squeeze(1)
    return torch.where(is_greedy, greedy(logits), sampled)
