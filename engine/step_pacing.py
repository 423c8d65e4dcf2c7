"""Prompt chunks paced by measured step times, so that running streams keep their pace.

While sequences decode, a waiting prompt rides in their step (``Engine._mixed_step``), and
every running stream waits for that whole step before its next token. A step carrying a
whole token budget of prompt takes several decode steps (docs/bench/step_budget.md), so a
fixed token budget makes a stream's inter-token latency jump whenever a prompt arrives.
Pacing bounds the prompt tokens of such a step by time instead: the step may take at most
``ratio`` decode steps, as measured when the engine starts (``measure``: every decode batch
size and packed token count the engine pads to, timed as the engine runs them: graph
replays where it has graphs, queued back to back, ``timed_seconds``). A prompt then goes
in as many steps as that takes; with nothing decoding, it still takes the whole token
budget (no stream waits for it).

The decode step it is measured against is that of the batch the streams will decode in
once the prompts queued and in progress have joined them, not of the streams decoding
now: their steps take that long then anyway, and a few streams beside a long queue would
otherwise hold every queued prompt to a few tokens a step, so that the batch stays small
and the bound tight (docs/design/kv_cache.md has the run that showed it).

The chunk is rounded up to fill its padded size: a packed step of D decode tokens and T
prompt tokens costs the step of its bucket (``cuda_graphs.prefill_buckets``), so the
largest bucket within the time is taken whole. At least ``least`` prompt tokens go in
every step, so that a prompt always progresses: a batch too large for any bucket within
the time gets the smallest bucket that holds it and them.

The bound gives way where the requests need more prompt tokens a step than it lets in
(``Pacing``): each sequence in the engine brings its prompt for the tokens it will generate,
so prefill keeps pace with decode only if a step takes, summed over them, each prompt's
tokens over its expected output (its ``max_tokens``, or the mean output of the requests
finished so far where less). Where the bound lets in fewer, a step takes that sum, raised to
fill its padded size as the bound's are. The sum follows the requests, not the schedule:
a rule that counts what the schedule has let in (the streams decoding, or the prompts
submitted per step, which closed-loop clients slow down with the server) shrinks its own
steps until prompts starve (docs/design/kv_cache.md, "Rejected alternatives").
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepTimes:
    """Seconds of one engine step: ``decode[b]``, a decode step padded to ``b`` sequences;
    ``packed[t]``, a packed step (prompt chunks and decode tokens) padded to ``t`` tokens."""

    decode: dict[int, float]
    packed: dict[int, float]

    def decode_seconds(self, batch: int) -> float:
        """A decode step of ``batch`` sequences: that of the padded size holding it (the
        largest measured beyond them)."""
        return self.decode[min((b for b in self.decode if b >= batch), default=max(self.decode))]

    def prompt_tokens(self, decoding: int, ratio: float, least: int, batch: int = 0) -> int:
        """Prompt tokens for a step beside ``decoding`` decode tokens, such that the step
        takes at most ``ratio`` decode steps of ``batch`` sequences (default: ``decoding``):
        the largest padded size within that time, less the decode tokens; at least
        ``least`` (the smallest padded size holding ``decoding + least``, or ``least`` past
        every measured size)."""
        limit = ratio * self.decode_seconds(max(batch, decoding))
        within = [t for t, s in self.packed.items() if t >= decoding + least and s <= limit]
        return max(within) - decoding if within else self.filled(decoding, least)

    def filled(self, decoding: int, tokens: int) -> int:
        """``tokens`` prompt tokens beside ``decoding`` decode tokens, raised to fill the
        smallest padded size holding them all (``tokens`` past every measured size): the
        step costs that size whatever it carries."""
        return min((t for t in self.packed if t >= decoding + tokens), default=decoding + tokens) - decoding

    def summary(self) -> str:
        ms = lambda d: ", ".join(f"{k}: {v * 1e3:.2f}" for k, v in sorted(d.items()))  # noqa: E731
        return f"decode step ms by batch {{{ms(self.decode)}}}; packed step ms by tokens {{{ms(self.packed)}}}"


# Calls queued back to back in one GPU measurement (``timed_seconds``): enough that the
# first call's preparation, not hidden behind an earlier one, is a small share.
QUEUED = 4


def timed_seconds(run: Callable[[], object], device: torch.device, repeats: int = 5) -> float:
    """The seconds one ``run()`` takes as the engine runs its steps, the shortest of
    ``repeats`` measurements after one untimed call. On a GPU each measurement queues
    ``QUEUED`` calls back to back and waits for the last: the engine queues a step behind
    the one whose tokens it reads, so a step costs the larger of its host preparation and
    its device time, not their sum (a call waited for alone would add its preparation to
    its device time, which the engine's queued steps hide). The shortest, not the median: what else runs on the machine only adds time, and a
    start-up measurement must not take that for the step's cost."""
    on_cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if on_cuda else (lambda: None)
    queued = QUEUED if on_cuda else 1
    run()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(queued):
            run()
        sync()
        times.append((time.perf_counter() - t0) / queued)
    return min(times)


def _rising(times: dict[int, float]) -> dict[int, float]:
    """``times`` by size, each raised to the largest time of the smaller sizes: a padded
    step does the work of every smaller one, so a lower reading is noise."""
    out, most = {}, 0.0
    for size in sorted(times):
        most = max(most, times[size])
        out[size] = most
    return out


def measure(decode: Callable[[int], object], packed: Callable[[int], object], batches: list[int],
            tokens: list[int], device: torch.device) -> StepTimes:
    """Time ``decode(b)`` for every batch size and ``packed(t)`` for every token count."""
    return StepTimes(_rising({b: timed_seconds(lambda: decode(b), device) for b in batches}),
                     _rising({t: timed_seconds(lambda: packed(t), device) for t in tokens}))


# The mean output of the finished requests weighs each finish 1/16: the last few dozen.
OUTPUT_WEIGHT = 1 / 16


@dataclass
class Pacing:
    """An engine's pacing: its measured step ``times``, the ``ratio`` of a decode step that
    a step with prompt chunks may take, its fewest prompt tokens (``least``), and the mean
    output of the requests finished so far (``OUTPUT_WEIGHT``; 0 before the first)."""

    times: StepTimes
    ratio: float
    least: int
    mean_output: float = 0.0

    def finished(self, generated: int) -> None:
        """A sequence ended after ``generated`` tokens."""
        if self.mean_output == 0.0:
            self.mean_output = float(generated)
        else:
            self.mean_output += OUTPUT_WEIGHT * (generated - self.mean_output)

    def demand(self, sequences: Iterable[tuple[int, int]]) -> float:
        """Prompt tokens a step must take, on average, for prefill to keep pace with
        decode: over ``sequences`` (the prompt tokens each prefills, and its
        ``max_tokens``), each prompt over its expected output, the smaller of its
        ``max_tokens`` and the finished requests' mean."""
        mean = self.mean_output or math.inf
        return sum(prompt / max(1.0, min(max_tokens, mean)) for prompt, max_tokens in sequences)

    def prompt_tokens(self, decoding: int, batch: int = 0, demand: float = 0.0) -> int:
        """Prompt tokens for a step beside ``decoding`` decode tokens, once the prompts
        queued and in progress make a batch of ``batch``: the time bound's
        (``StepTimes.prompt_tokens``), or where the ``demand`` is larger, that, raised to
        fill its padded step (16 decode and 125 prompt tokens pad to the 192-token step:
        it carries 176 prompt tokens, as it costs 192 anyway)."""
        bound = self.times.prompt_tokens(decoding, self.ratio, self.least, batch)
        floor = math.ceil(demand)
        return bound if floor <= bound else self.times.filled(decoding, floor)
