"""Continuous-batching generation engine.

One background thread owns the model and the KV cache and loops:

1. admit waiting requests while KV blocks are free and prefill their prompts together, in
   chunks packed into one forward (M = the tokens in it, so that each weight is read once
   for all of them and the host launches one forward, not one per request; on CUDA up to a
   few hundred tokens a replay of the packed graph of the padded token count,
   ``cuda_graphs.PackedGraphs``, as such a forward is bound by its launches); the tokens of
   a step are bounded (``max_prefill_tokens``): a prompt that does not fit is prefilled in
   chunks over the next iterations (chunked prefill). While sequences run, their decode
   tokens go into the same forward, each a chunk of one (``_mixed_step``): a running
   stream then waits one budgeted step between two tokens, not a prefill and a step;
2. with nothing to prefill, run one decode step for every running sequence together (one
   forward, M = batch; on CUDA a replay of the graph captured for the padded batch size,
   ``cuda_graphs.py``, whose timed twin keeps the kernel metrics' latencies flowing:
   ``kernels/observe.py``);
3. sample every row in one pass on the device (only the new ids come back to the host),
   hand each request its new text through its sink, and free the blocks of finished or
   cancelled requests.

Look-ahead: on CUDA, while no newcomer is to be prefilled and the next step is a graph
replay, the next decode step is queued right behind this one, fed on the device with this
step's sampled ids (``DecodeGraphs.run_next``; where sequences end by length with this
step's token, for the rest of the batch: ``_launch_rows_ahead``), before this step's ids
are read back. The host's bookkeeping -- detokenising, stop checks, building the next
step -- then runs while the GPU decodes, instead of between two steps with the GPU idle
(as vLLM's async scheduling). A sequence that turns out to have ended (end of sequence,
stop string, cancelled) had one step too many computed for it: that step is dropped, and
the next step is launched from the host's state. Its KV write went to a position past the
sequence's end, in a slot that a later prefill overwrites and that decode attention
never reads past a sequence's length. Mixed steps are queued the same way, one behind
the other, while prompts are left to mix (``_queue_mixed``), and behind a decode step
when a prompt is waiting: the next step's decode tokens are fed on the device with this
step's ids and its prompt chunks planned before this step's ids are read; a row of a
sequence that ended meanwhile is dropped, the rest of that step kept; the decode step
after the last of them is queued behind it (``_queue_decode_behind``). Every input a
queued step takes from the host is copied from pinned memory: a copy from pageable memory
would wait for the step queued before it.

Sinks run on this thread, but a step's events are handed out only once the step whose
tokens are read next is on the GPU (``_deliver`` after its launch or the look-ahead's,
before the wait for its tokens): what a sink sets off -- the HTTP server's event loop
turning each token into a streamed chunk -- then runs while the GPU works, instead of
holding the GIL while this thread prepares a launch with the GPU idle. With a step queued
ahead they are handed out before the host prepares the step after it, not after: a
stream's gap between two tokens is then the GPU's time between two steps, and does not
carry the difference between the preparations of two kinds of step (a mixed step's
planning and inputs take longer than a decode step's; docs/design/kv_cache.md).

KV memory is paged (``models/kv_cache.py``, ``kv_space.py``): blocks of ``block_size``
positions from one pool, which on CUDA takes ``gpu_memory_fraction`` of the GPU less what
is in use and the measured peak of the largest step (``kv_blocks_for_budget``). A sequence
holds a row of the block table (its ``slot``) and the blocks its positions need, taken as
it grows. Requests are admitted while a row and the blocks of their prompt are free, up to
``max_num_seqs`` running; beyond that they wait in a bounded queue, and beyond that
``submit`` refuses them (``QueueFullError``: the HTTP layer answers 429). When a decoding
sequence needs a block and none is free, the most recently admitted sequence is preempted:
its blocks go back (its full ones stay in the prefix cache), and it waits at the head of
the queue to be prefilled again from its prompt and the tokens it has generated (it then
goes on where it stopped; nothing is sent twice). With ``prefix_caching`` a newcomer's
prompt starts from the cached blocks of its leading run (``kv_blocks.py``).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from ..kernels.device import to_device
from ..models.batches import TILE_TOKENS, Decode, Prefill
from ..models.kv_cache import KVCache
from .kv_blocks import BlockPool
from .kv_space import KVSpace, SequenceBlocks
from ..models.llama import CausalLM
from .decode import DecodeRunner
from .detokenizer import TextStream
from .grammar import GrammarMatchers
from .logits import BatchSampling, Logprobs, TokenHistory, TokenLogprob
from .sampling import SamplingParams, greedy
from .step_pacing import Pacing, StepTimes, measure
from .tensor_parallel import Leader

log = logging.getLogger("woq.engine")

# Tokens of one step (decode tokens and prompt chunks): a running stream waits one such step
# between two tokens, so this bounds its stall. 512 is the largest packed graph: a step up
# to it costs its GPU time, a larger one is eager and host-bound on top (the measured curve
# and the budgets tried: docs/design/kv_cache.md).
DEFAULT_PREFILL_TOKENS = 512
# On CUDA, while streams decode, a step takes at most twice their decode step, or the
# prompt tokens the requests need per step where more (``step_pacing.py``), so that a
# stream's slowest waits between two tokens stay near twice its median, for some tokens/s
# against the token budget alone (the served runs: docs/design/kv_cache.md).
# Off on the CPU, whose steps are not queued ahead and whose start-up timing takes seconds.
DEFAULT_MIXED_STEP_RATIO = 2.0
# A paced step's fewest prompt tokens (``step_pacing.py``), so that a prompt always
# progresses: one query tile of the chunk kernel.
PACED_LEAST_TOKENS = TILE_TOKENS


class QueueFullError(RuntimeError):
    pass


class RequestTooLongError(ValueError):
    pass


class EngineStoppedError(RuntimeError):
    pass


@dataclass
class StreamEvent:
    """What a request receives after each step: new text (maybe empty) and, at the end,
    the finish reason ("stop" | "length" | "abort" | "error") with token counts; where the
    request asked (``SamplingParams.logprobs``), each new token's log-probabilities."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None


class EngineObserver(Protocol):
    def on_step(self, batch_size: int, prefill_tokens: int) -> None:
        """A step decoded ``batch_size`` sequences (0: a prefill with nothing to decode yet,
        such as a long prompt's earlier chunks) and prefilled ``prefill_tokens`` prompt
        tokens, in its own forward or beside the decode tokens."""

    def on_iteration(self, kind: str, seconds: float) -> None:
        """An iteration of the engine's loop took ``seconds`` of wall time, from handing out
        the last one's tokens to having this one's: the wait between two tokens of a stream
        running through it. ``kind``: "decode" (decode tokens only), "mixed" (decode tokens
        and prompt chunks: in one forward, or in a prefill of its own before a decode step
        queued ahead) or "prefill" (prompt chunks with nothing to decode)."""

    def on_first_token(self, seconds: float) -> None: ...

    def on_preempt(self) -> None: ...

    def on_token_latency(self, seconds: float) -> None: ...

    def on_finish(self, finish_reason: str, prompt_tokens: int, completion_tokens: int, seconds: float) -> None: ...


Sink = Callable[[StreamEvent], None]


@dataclass
class _Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Sink
    seed: int
    stream: TextStream | None  # None: token ids only (an engine without a tokenizer)
    submitted: float
    slot: int = -1  # the sequence's row of the block table (-1: none)
    kv: SequenceBlocks | None = None  # its blocks
    admitted: int = -1  # admission order (the newest is preempted first)
    generated: list[int] = field(default_factory=list)
    last_token_time: float = 0.0
    cancelled: bool = False
    prefilled: int = 0  # context tokens in the cache so far (a long prompt comes in chunks)
    # context tokens its admission left to prefill (its cached prefix not counted; None:
    # not admitted yet), the prompt work it brings (``step_pacing.Pacing.demand``)
    to_prefill: int | None = None
    # A request's further choices (n > 1): each a sequence of its own, sharing this one's
    # prompt blocks once it is prefilled (one prefill for all); ``forked`` once they are.
    siblings: list["_Sequence"] = field(default_factory=list)
    forked: bool = False
    # a further choice's first choice, which ``by_id`` holds until every choice has ended
    head: "_Sequence | None" = field(default=None, repr=False, compare=False)
    finished: bool = False
    matcher: object | None = None  # the grammar's llguidance matcher (SamplingParams.grammar)

    @property
    def next_position(self) -> int:
        """Cache position of the token fed next (the last sampled one)."""
        return len(self.prompt_ids) + len(self.generated) - 1

    def context(self) -> list[int]:
        """The tokens whose keys and values a prefill writes: the prompt, and after a
        preemption the generated tokens but the last (which the next decode step feeds)."""
        return self.prompt_ids + self.generated[:-1]


@dataclass
class _Launched:
    """A decode step queued on the device: its sequences, their sampled ids on the device,
    and (CUDA) the ids' host copy, valid once ``ready`` has passed."""

    seqs: list[_Sequence]
    tokens: torch.Tensor  # [B] int64, on the device
    host: torch.Tensor | None  # [B] pinned; None on CPU
    ready: torch.cuda.Event | None
    sampling: BatchSampling | None  # the rows' sampling; None: all greedy, nothing else asked
    graph: bool  # replayed from a captured graph (a look-ahead can follow it)
    logprobs: Logprobs | None = None  # host copies (valid with the ids), where some row asked

    def token_ids(self) -> list[int]:
        """The sampled ids; waits for this step only, not for the steps queued after it."""
        if self.ready is None:
            return self.tokens.tolist()
        self.ready.synchronize()
        return self.host[: len(self.seqs)].tolist()


@dataclass
class _QueuedMixed:
    """A mixed step queued behind another one (``Engine._queue_mixed``): its sampled rows
    (``step``: the decode rows first, then the sequences its chunks started), how many of
    them are decode rows, and the prompt tokens its chunks carry."""

    step: _Launched
    decoded: int
    prompt_tokens: int


def kv_blocks_for_budget(model: CausalLM, fraction: float, block_size: int, prefill_tokens: int) -> tuple[int, str]:
    """How many KV blocks of ``block_size`` positions fit in ``fraction`` of the GPU's memory
    after what is in use now (weights, other processes) and the activation peak of a prefill
    of ``prefill_tokens`` tokens, measured by running one (as vLLM profiles). Also a summary."""
    dev = model.device
    torch.cuda.synchronize(dev)
    free, total = torch.cuda.mem_get_info(dev)
    base = torch.cuda.memory_allocated(dev)
    # in use: other processes + our live tensors (not blocks our allocator caches for reuse)
    in_use = total - free - torch.cuda.memory_reserved(dev) + base
    torch.cuda.reset_peak_memory_stats(dev)
    n = max(1, min(prefill_tokens, model.max_seq_len))
    model(torch.zeros(1, n, dtype=torch.long, device=dev), last_only=True)
    torch.cuda.synchronize(dev)
    activations = torch.cuda.max_memory_allocated(dev) - base
    cfg = model.cfg
    per_block = KVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype) * block_size
    graphs_and_slack = 512 << 20  # CUDA graph pools, cuBLAS workspaces, allocator rounding
    budget = fraction * total - in_use - activations - graphs_and_slack
    blocks = max(0, int(budget // per_block))
    gib = 1 << 30
    summary = (f"{fraction:.2f} of {total / gib:.1f} GiB; in use {in_use / gib:.2f} GiB, prefill peak "
               f"{activations / gib:.2f} GiB -> {max(budget, 0) / gib:.2f} GiB for the KV cache, "
               f"{blocks} blocks of {block_size} positions")
    return blocks, summary


def _same(a: list[_Sequence], b: list[_Sequence]) -> bool:
    """The same sequences in the same order (identity: _Sequence compares by value)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


class Engine:
    def __init__(
        self,
        model: CausalLM,
        tokenizer,
        eos_token_ids: set[int],
        max_num_seqs: int | None = None,
        max_queue: int = 64,
        max_seq_len: int | None = None,
        max_prefill_tokens: int = DEFAULT_PREFILL_TOKENS,
        observer: EngineObserver | None = None,
        cuda_graphs: bool = True,
        prefill_graphs: bool = True,
        gpu_memory_fraction: float = 0.9,
        kv_cache_gib: float = 1.0,
        block_size: int = 16,
        prefix_caching: bool = True,
        mixed_step_ratio: float | None = None,
        overlap_mixed_steps: bool | None = None,
        mirror: Leader | None = None,
    ):
        """``max_num_seqs``: sequences running at once (default 256 on CUDA, 64 elsewhere);
        the KV pool: on CUDA ``gpu_memory_fraction`` of the GPU (``kv_blocks_for_budget``),
        elsewhere ``kv_cache_gib``; never more blocks than ``max_num_seqs`` sequences of
        ``max_seq_len`` positions could hold. ``mixed_step_ratio``: while sequences decode,
        a step's prompt chunks are bounded so that it takes at most this many of their
        decode steps, by step times measured here, unless the requests need more prompt
        tokens a step to keep pace (``step_pacing.py``; 0: the token budget alone; None:
        ``DEFAULT_MIXED_STEP_RATIO`` on CUDA, 0 elsewhere). ``mirror``: on rank 0
        of a tensor-parallel group, what announces each model call to the other ranks
        (``tensor_parallel.py``). ``overlap_mixed_steps``: queue a mixed step behind the one
        whose tokens the host is about to read (``_queue_mixed``; None: where that overlaps
        anything, on CUDA with packed graphs; on the CPU, where steps run as they are
        called, it only delays each step's tokens by one step)."""
        if mirror is not None:
            model = mirror.lead(model)
        self.model = model
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids)
        on_cuda = model.device.type == "cuda"
        self.max_num_seqs = max_num_seqs = max_num_seqs or (256 if on_cuda else 64)
        self.max_queue = max_queue
        self.max_seq_len = min(max_seq_len or model.max_seq_len, model.max_seq_len)
        self.max_prefill_tokens = max_prefill_tokens
        # a vocab-parallel model (a tensor-parallel rank's shard) picks greedy tokens itself,
        # gathering each rank's best instead of every logit (CausalLM.forward's ``greedy``)
        self.vocab_parallel = getattr(model, "vocab_share", None) is not None
        self.observer = observer
        cfg = model.cfg
        per_block = KVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype) * block_size
        most = max_num_seqs * -(-self.max_seq_len // block_size)  # every sequence at full length
        if on_cuda:
            # (the largest step: the budget, or every sequence's decode token and the quarter
            # of the budget left to prompts, ``_prefill_chunks``)
            step = max(max_prefill_tokens, max_num_seqs + max_prefill_tokens // 4)
            blocks, summary = kv_blocks_for_budget(model, gpu_memory_fraction, block_size, step)
        else:
            blocks, summary = int(kv_cache_gib * (1 << 30) // per_block), f"{kv_cache_gib:g} GiB"
        longest = min(blocks, most) * block_size  # the most positions one sequence can hold
        if longest < min(self.max_seq_len, 2 * block_size):
            raise ValueError(f"the KV cache does not fit: {summary}; lower --max-seq-len or raise "
                             f"--gpu-memory-fraction")
        log.info("KV cache: %s; %d blocks of %d positions for %d sequences", summary, min(blocks, most), block_size,
                 max_num_seqs)
        # the most positions one request can take (prompt + completion): a pool smaller than
        # one --max-seq-len sequence bounds it, and requests that leave max_tokens unset fill
        # this, not the context length
        self.context_len = min(self.max_seq_len, longest)
        if self.context_len < self.max_seq_len:
            log.warning("the KV cache holds %d positions, fewer than --max-seq-len %d: a request takes at most that",
                        longest, self.max_seq_len)
        # Block 0 and one more row: the scratch block, and the graphs' padding rows' row (every entry block 0).
        self.cache = KVCache(cfg.num_layers, max_num_seqs + 1, cfg.num_kv_heads, self.max_seq_len, cfg.head_dim,
                             model.dtype, model.device, block_size=block_size, num_blocks=1 + min(blocks, most))
        if mirror is not None:
            self.cache = mirror.attach(self.cache)
        salt = f"{cfg}|{model.dtype}".encode()  # (the pool serves this model only: its config names it)
        self.kv = KVSpace(self.cache, BlockPool(self.cache.num_blocks, block_size, prefix_caching, salt), max_num_seqs)
        self.preemptions = 0
        self._admitted = itertools.count()
        self.history: TokenHistory | None = None  # generated ids per slot, once a request has penalties
        self.grammars = GrammarMatchers(tokenizer, cfg.vocab_size, self.eos) if tokenizer is not None else None
        self.decode = DecodeRunner(model, self.cache)
        self.graphs = self.packed_graphs = None
        if on_cuda and cuda_graphs:
            from .cuda_graphs import PACKED_GRAPH_TOKENS, capture_engine_graphs

            # (a graph's packed attention is the chunk kernel: packed graphs need the fused ops)
            packed = min(PACKED_GRAPH_TOKENS, max_prefill_tokens) if prefill_graphs and model.options.fused_ops else 0
            if mirror is None:
                self.graphs, self.packed_graphs = capture_engine_graphs(self.decode, max_num_seqs, packed)
            else:  # every rank captures the same graphs, and replays them as rank 0 does
                self.graphs, self.packed_graphs = mirror.capture_graphs(model, self.cache, max_num_seqs, packed)
        if on_cuda:
            # Greedy sampling's argmax (Triton, kernels/argmax.py) runs outside the graphs, on
            # fp32 logits: compile it now rather than in the first request's first token.
            greedy(torch.zeros(1, cfg.vocab_size, device=model.device))
        self.pacing: Pacing | None = None
        if mixed_step_ratio is None:
            mixed_step_ratio = DEFAULT_MIXED_STEP_RATIO if on_cuda else 0.0
        if mixed_step_ratio:
            times = self._measure_steps()
            log.info("step times: %s", times.summary())
            self.pacing = Pacing(times, mixed_step_ratio, PACED_LEAST_TOKENS)
        self.steps = 0
        self.waiting: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []
        self.prefilling: list[_Sequence] = []  # holding a row, part of the context cached
        self.by_id: dict[str, _Sequence] = {}
        self._outbox: list[tuple[Sink, StreamEvent]] = []  # events not yet handed to their sinks
        # Look-ahead (module docstring): the step queued behind the one being read, and two
        # pinned host buffers for the sampled ids, one per step in flight.
        self._ahead: _Launched | None = None
        self._pinned = ([torch.empty(max_num_seqs, dtype=torch.long, pin_memory=True) for _ in range(2)]
                        if on_cuda else [])
        self._pinned_next = 0
        self.look_ahead_steps = 0  # look-ahead steps queued ...
        self.look_ahead_dropped = 0  # ... those dropped because the batch changed ...
        self.look_ahead_partial = 0  # ... and those for part of a batch, the rest ending by length
        # A mixed step queued behind the one being read (``_queue_mixed``), and how many were.
        self.overlap_mixed = self.packed_graphs is not None if overlap_mixed_steps is None else overlap_mixed_steps
        self._queued: _QueuedMixed | None = None
        self.mixed_steps_queued = 0  # mixed steps queued ahead ...
        self.mixed_rows_dropped = 0  # ... their rows of sequences that had ended by then ...
        self.mixed_behind_decode = 0  # ... and those queued behind a decode step
        self.decode_behind_mixed = 0  # decode steps queued behind a mixed step (``_queue_decode_behind``)
        self._cv = threading.Condition()
        self._stop = False
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    # -- public API (any thread) ---------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_blocks_total(self) -> int:
        return self.cache.num_blocks - 1

    @property
    def kv_blocks_used(self) -> int:
        """Blocks held by running or prefilling sequences (cached unreferenced ones are free)."""
        return self.kv.pool.num_used

    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self._loop, name="woq-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def context_limit(self) -> str:
        """What bounds a request's tokens (``context_len``), in words for its error messages."""
        if self.context_len == self.max_seq_len:
            return f"the context length of {self.context_len} tokens"
        return f"the KV cache's {self.context_len} positions"

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        if prompt_tokens < 1:
            raise RequestTooLongError("the prompt is empty")
        if prompt_tokens + max_tokens > self.context_len:
            raise RequestTooLongError(
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds {self.context_limit}")

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Sink, request_id: str | None = None,
               choices: list[Sink] | None = None) -> str:
        """Queue a request; its events go to ``sink`` (called on the engine thread).
        ``choices``: the sinks of further choices of the same prompt (OpenAI's ``n``), which
        share its prefill; choice i draws with seed ``seed + i`` (a seeded request stays
        reproducible)."""
        self.check_fits(len(prompt_ids), params.max_tokens)
        if self.tokenizer is None and (params.stop or params.grammar is not None):
            raise ValueError("stop strings and grammars need a tokenizer")
        choices = choices or []
        if 1 + len(choices) > self.max_num_seqs:
            raise ValueError(f"n = {1 + len(choices)} exceeds the server's batch of {self.max_num_seqs} sequences")
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        rid = request_id or f"req-{next(self._ids)}"
        now = time.perf_counter()

        def sequence(i: int, s: Sink) -> _Sequence:
            # (a grammar's matcher is built here, on the caller's thread, not the engine's)
            return _Sequence(f"{rid}/{i}" if i else rid, list(prompt_ids), params, s, (seed + i) % (1 << 63),
                             TextStream(self.tokenizer, params.stop, params.include_stop_str)
                             if self.tokenizer is not None else None, now,
                             matcher=self.grammars.matcher(params.grammar) if params.grammar is not None else None)

        seq = sequence(0, sink)
        seq.siblings = [sequence(i + 1, s) for i, s in enumerate(choices)]
        for sibling in seq.siblings:
            sibling.head = seq
        with self._cv:
            if self._stop:
                raise EngineStoppedError("the server is shutting down")
            # Waiting requests up to the free rows are about to be admitted, not queued: a
            # burst on an idle server gets the free rows and the queue (the engine thread
            # admits between steps, after the burst has arrived).
            if len(self.waiting) >= self.max_queue + len(self.kv.free_rows):
                raise QueueFullError(f"the request queue is full ({self.max_queue} waiting)")
            self.waiting.append(seq)
            self.by_id[rid] = seq
            self._cv.notify_all()
        return rid

    def cancel(self, request_id: str) -> None:
        """Abort a request (client gone): its blocks are freed at the next step."""
        with self._cv:
            seq = self.by_id.get(request_id)
            if seq is not None:
                for s in [seq, *seq.siblings]:
                    s.cancelled = True
                self._cv.notify_all()

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> StreamEvent:
        """Blocking convenience: the whole completion as one event (text, ids, reason)."""
        done = threading.Event()
        parts: list[StreamEvent] = []

        def sink(ev: StreamEvent) -> None:
            parts.append(ev)
            if ev.finish_reason:
                done.set()

        self.submit(prompt_ids, params, sink)
        done.wait()
        last = parts[-1]
        logprobs = [lp for p in parts for lp in (p.logprobs or [])] if params.logprobs is not None else None
        return StreamEvent("".join(p.text for p in parts), [t for p in parts for t in p.token_ids],
                           last.finish_reason, last.prompt_tokens, last.completion_tokens, last.error, logprobs)

    # -- engine thread -------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            # (the last iteration's events are handed out by this one's step, once its kernels
            # are queued: ``_deliver``)
            start = time.perf_counter()
            with self._cv:
                self._reap_cancelled()
                while (not self._stop and not self.running and not self.prefilling and not self.waiting
                       and self._queued is None):
                    self._deliver()
                    self._cv.wait()
                    start = time.perf_counter()  # (an idle wait is no iteration's time)
                if self._stop:
                    break
                queued, self._queued = self._queued, None
                # With sequences running (and no step queued ahead for them) and prompts to
                # prefill, the decode tokens ride in the prefill's forward: one forward a
                # step, within the token budget. The running sequences get their next
                # positions' blocks before newcomers are admitted.
                decoding, chunks = [], []
                if queued is None:
                    if self.running and self._ahead is None and (self.prefilling or self.waiting):
                        decoding = self._make_room([s for s in self.running if not s.cancelled])
                    # Behind a decode step queued ahead, prompts go in the mixed step that
                    # ``_decode_step`` queues behind it, not in a forward of their own between
                    # the two, which every running stream would wait for.
                    if self._ahead is None or not self.overlap_mixed:
                        chunks = self._prefill_chunks(len(decoding))
            try:
                if queued is not None:
                    self._queued_step(queued)
                    kind = "mixed"
                elif chunks and decoding:
                    self._mixed_step(decoding, chunks)
                    kind = "mixed"
                else:
                    prefill_tokens = self._prefill(chunks) if chunks else 0
                    decoded = bool(self.running) and self._decode_step(prefill_tokens)
                    if prefill_tokens and not decoded and self.observer:
                        self.observer.on_step(0, prefill_tokens)  # (chunks with nothing to decode yet)
                    kind = "decode" if decoded else ""
                    if prefill_tokens:
                        kind = "mixed" if decoded else "prefill"
                if kind and self.observer:
                    self.observer.on_iteration(kind, time.perf_counter() - start)
            except Exception as exc:  # never let one bad step kill the server
                log.exception("engine step failed")
                self._ahead = self._queued = None
                failed = [s for s, _, _ in chunks] + self.running + self.prefilling
                for seq in {id(s): s for s in failed}.values():
                    self._finish(seq, "error", error=f"generation failed: {type(exc).__name__}")
        for seq in list(self.running) + list(self.prefilling) + list(self.waiting):
            self._finish(seq, "abort", error="the server shut down")
        self._deliver()

    def _deliver(self) -> None:
        """Hand out the events queued since the last call, in order."""
        events, self._outbox = self._outbox, []
        for sink, ev in events:
            sink(ev)

    def _prefill_chunks(self, decoding: int = 0) -> list[tuple[_Sequence, int, int]]:
        """This iteration's prefill work within the token budget less ``decoding`` tokens
        (a mixed step's decode tokens; a quarter of the budget is left for prefill however
        many decode, so that prompts are not starved), as
        (sequence, first position, tokens): first the rest of contexts begun earlier, then
        waiting requests admitted now (a row and their context's blocks free; a cached
        prefix is not prefilled again); the last one taken may get only a chunk of its
        context."""
        chunks, budget = [], self._step_budget(decoding)
        # Paced (step_pacing.py): running streams wait for this step, so its time is bounded
        # by theirs. A prefill of its own, between a decode step queued ahead and the next
        # (without ``overlap_mixed``), is paced as if it carried their tokens.
        if self.pacing is not None and (self.prefilling or self.waiting):  # (else nothing to bound)
            streams = decoding or len(self.running)
            if streams:
                batch = min(self.max_num_seqs, streams + len(self.prefilling) + len(self.waiting))
                budget = min(budget, self.pacing.prompt_tokens(streams, batch, self._prompt_demand()))
        for seq in self.prefilling:
            if budget == 0:
                break
            n = min(len(seq.context()) - seq.prefilled, budget)
            chunks.append((seq, seq.prefilled, n))
            budget -= n
        while budget and self.waiting and len(self.running) + len(self.prefilling) < self.max_num_seqs:
            seq = self.waiting[0]
            context = seq.context()
            if self._shares_a_block_being_prefilled(context):
                break  # admitted once that block is cached, it is not prefilled twice
            admitted = self.kv.admit(context, reserve=1)  # (and the first decode step's position)
            if admitted is None:
                break  # first come, first served: no one overtakes the head of the queue
            self.waiting.popleft()
            seq.kv, seq.prefilled = admitted
            seq.to_prefill = len(context) - seq.prefilled
            seq.slot, seq.admitted = seq.kv.row, next(self._admitted)
            self.prefilling.append(seq)
            n = min(len(context) - seq.prefilled, budget)
            chunks.append((seq, seq.prefilled, n))
            budget -= n
        return chunks

    def _prompt_demand(self) -> float:
        """Prompt tokens a step must take for prefill to keep pace with decode
        (``Pacing.demand``), over the sequences that will make the batch: the running and
        prefilling ones, and the queue's first up to ``max_num_seqs`` in all (a waiting one
        counted whole: its cached prefix is found at admission)."""
        admitted = [*self.running, *self.prefilling]
        queued = itertools.islice(self.waiting, max(0, self.max_num_seqs - len(admitted)))
        return self.pacing.demand([(s.to_prefill, s.params.max_tokens) for s in admitted if s.to_prefill is not None]
                                  + [(len(s.context()), s.params.max_tokens) for s in queued])

    def _step_budget(self, decoding: int) -> int:
        """Prompt tokens a step may take beside ``decoding`` decode tokens, before pacing:
        the budget less them, but a quarter of it at least, so that prompts are not starved."""
        return max(self.max_prefill_tokens - decoding, self.max_prefill_tokens // 4, 1)

    def _measure_steps(self) -> StepTimes:
        """The time of a decode step at every batch size the engine pads to and of a packed
        step at every token count (``step_pacing.measure``), run as the engine runs them
        (graph replays where it has graphs) on the scratch row: every entry of row
        ``max_num_seqs`` is the scratch block, which no sequence holds. Not counted in the
        kernel metrics."""
        from .cuda_graphs import batch_buckets, prefill_buckets

        dev, scratch = self.model.device, self.max_num_seqs

        def decode(b: int) -> torch.Tensor:
            ids = torch.zeros(b, 1, dtype=torch.long, device=dev)
            positions = torch.zeros(b, 1, dtype=torch.long, device=dev)
            slots = torch.full((b,), scratch, dtype=torch.long, device=dev)
            if self.graphs is not None:
                return self.graphs.run(ids, positions, slots)
            return self.decode(ids, Decode.at(positions, slots))

        def packed(t: int) -> torch.Tensor:
            return self._packed_forward([0] * t, [t], [scratch], [0])

        timing = self.model.kernel_timing
        with timing.quiet() if timing is not None else contextlib.nullcontext():
            return measure(decode, packed, batch_buckets(self.max_num_seqs),
                           prefill_buckets(min(self.max_prefill_tokens, self.max_seq_len)), dev)

    def _shares_a_block_being_prefilled(self, context: list[int]) -> bool:
        """Whether a sequence being prefilled shares with ``context`` the full block after its
        own cached ones (blocks are cached once written: requests with one system prompt
        arriving together would otherwise all prefill it)."""
        if not self.kv.pool.prefix_caching:
            return False
        bs = self.cache.block_size
        for other in self.prefilling:
            end = (other.kv.registered + 1) * bs  # (the new block must not hold context's last token)
            if end < len(context) and end <= len(other.prompt_ids) and other.prompt_ids[:end] == context[:end]:
                return True
        return False

    def _reap_cancelled(self) -> None:
        for seq in [s for s in self.waiting if s.cancelled]:
            self.waiting.remove(seq)
            self._finish(seq, "abort")
        for seq in [s for s in self.running + self.prefilling if s.cancelled]:
            self._finish(seq, "abort")

    def _packed_forward(self, ids: list[int], lens: list[int], slots: list[int], starts: list[int],
                        fed: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[chunks, V]`` of each chunk's last token, from one packed forward of the
        chunks (``lens[i]`` of ``ids`` at positions ``starts[i]...`` of row ``slots[i]``): a
        graph replay where one fits, else the eager forward. ``fed``: ids on the device for
        the first ``len(fed)`` tokens, in place of those of ``ids``."""
        graphs = self.packed_graphs
        if graphs is not None and graphs.fits(len(ids), len(lens)):
            return graphs.run(ids, lens, slots, starts, fed)
        dev = self.model.device
        batch = Prefill.pack(lens, slots, dev, starts)
        tokens = torch.tensor([ids], device=dev)
        if fed is not None:
            tokens[0, :len(fed)] = fed
        return self.model(tokens, batch, self.cache, last_only=True)

    def _prefill(self, chunks: list[tuple[_Sequence, int, int]]) -> int:
        """Prefill ``chunks`` in one packed forward and start the sequences whose context is
        then complete (``_prefilled``) with their first tokens. Returns the tokens prefilled."""
        contexts = [s.context() for s, _, _ in chunks]
        self.kv.flush()
        logits = self._packed_forward(*self._chunk_inputs(chunks, contexts))
        first, rows = self._prefilled(chunks, contexts)
        if first:
            self.kv.flush()
            self._emit_tokens(first, logits[self._rows(rows)], first)
        else:
            self._deliver()  # the previous step's events, while this one runs
        return sum(n for _, _, n in chunks)

    def _mixed_step(self, seqs: list[_Sequence], chunks: list[tuple[_Sequence, int, int]]) -> None:
        """One forward for the decode tokens of running ``seqs`` (each a chunk of one, at its
        next position, whose block it has) and ``chunks``; then one sampling pass for
        ``seqs`` and the sequences whose context the chunks completed (their first tokens)."""
        self.kv.flush()
        contexts = [s.context() for s, _, _ in chunks]
        ids, lens, slots, starts = self._chunk_inputs(chunks, contexts)
        logits = self._packed_forward([s.generated[-1] for s in seqs] + ids, [1] * len(seqs) + lens,
                                      [s.slot for s in seqs] + slots, [s.next_position for s in seqs] + starts)
        first, rows = self._prefilled(chunks, contexts)
        self.kv.flush()
        self.steps += 1
        if self.observer:
            self.observer.on_step(len(seqs), sum(n for _, _, n in chunks))
        step = self._sample(seqs + first, self._sampled_rows(logits, len(seqs), rows), first)
        self._read_mixed(step)

    def _queue_mixed(self, step: _Launched) -> None:
        """With ``overlap_mixed``, queue the next mixed step behind ``step`` (a mixed step
        whose ids the host has not read): the host's part of ``step`` (reading its ids,
        detokenizing, handing out events) then runs while the GPU computes the next one,
        as a decode step queued ahead does (module docstring). Its decode rows are
        ``step``'s sequences that go on past this token (by length), fed on the device with
        the ids ``step`` sampled, one position further; its prompt chunks are planned now
        (``_prefill_chunks``). Nothing is queued with no prompt left to mix (the next step
        decodes: ``_queue_decode_behind``), nor where the next iteration may have to decide on
        the host: a row needing a block that is not free (no preemption ahead), a running
        sequence outside ``step`` (resumed after a preemption: its token is on the host), a
        grammar or penalties (their state follows the host's tokens), or a step larger than
        the packed graphs (on CUDA). A sequence that ends with ``step``'s token (end of
        sequence, a stop string, cancelled) had one token too many computed: it is dropped
        when the queued step is read (``_queued_step``); its KV write went past its end,
        into a block that only a later step, queued after it, can give to another
        sequence."""
        if not self.overlap_mixed or not (self.prefilling or self._may_admit()):
            return
        rows = self._rows_fed_ahead(step)
        if rows is None:
            return
        seqs = [step.seqs[i] for i in rows]
        graphs = self.packed_graphs  # (pacing only lowers the budget: the step's tokens are at most these)
        most = len(seqs) + self._step_budget(len(seqs))
        if self.model.device.type == "cuda" and (graphs is None or most > graphs.max_tokens):
            return
        with self._cv:  # (admission reads the queue that ``submit`` appends to, as in ``_loop``)
            if not self._room_ahead(seqs):
                return
            chunks = self._prefill_chunks(len(seqs))
        if not chunks:
            return
        self.kv.flush()  # (the blocks of sequences admitted now)
        contexts = [s.context() for s, _, _ in chunks]
        ids, lens, slots, starts = self._chunk_inputs(chunks, contexts)
        fed = self._fed_ids(step, rows)
        logits = self._packed_forward([0] * len(seqs) + ids, [1] * len(seqs) + lens, [s.slot for s in seqs] + slots,
                                      [s.next_position + 1 for s in seqs] + starts, fed)
        first, started = self._prefilled(chunks, contexts)
        self.kv.flush()
        decoded = len(seqs)
        picked = self._sampled_rows(logits, decoded, started)
        self._queued = _QueuedMixed(self._sample(seqs + first, picked, first, ahead=decoded), decoded,
                                    sum(n for _, _, n in chunks))
        self.mixed_steps_queued += 1

    def _queued_step(self, queued: _QueuedMixed) -> None:
        """Read a mixed step queued by ``_queue_mixed``, after queuing the next one behind it;
        the rows of sequences that ended since are dropped."""
        self.steps += 1
        if self.observer:
            self.observer.on_step(queued.decoded, queued.prompt_tokens)
        self.mixed_rows_dropped += self._read_mixed(queued.step)

    def _read_mixed(self, step: _Launched) -> int:
        """Hand out the last step's events while the GPU works, queue the next mixed step
        behind ``step`` (``_queue_mixed``), then read and accept ``step``'s tokens. Returns
        the rows dropped (``_accept_all``)."""
        self._deliver()
        self._queue_mixed(step)
        if self._queued is None:
            self._queue_decode_behind(step)
        return self._accept_all(step.seqs, step.token_ids(), step.logprobs)

    def _queue_decode_behind(self, step: _Launched) -> None:
        """Where no mixed step follows ``step`` (a mixed step whose ids the host has not
        read) because no prompt is left to mix, queue the decode step after it for its
        sequences that go on past this token (``_launch_rows_ahead``), so that the GPU
        does not idle while the host reads ``step``'s ids and launches that step. A prompt
        that arrives meanwhile then goes in a mixed step queued behind this decode step
        (``_decode_step``), not in one launched from the host once ``step`` is read: the
        last two kinds of step launched with the GPU idle (docs/design/kv_cache.md, "Where
        a stream's slow gaps come from"). Not queued where the next iteration may have to
        decide on the host, as in ``_queue_mixed``; a sequence that ends with ``step``'s
        token by a stop drops the decode step (``_decode_step``: the batch changed)."""
        if not self.overlap_mixed or self.prefilling or self._may_admit():
            return  # (a prompt waits that ``_queue_mixed`` could not queue: planned on the host)
        self.decode_behind_mixed += self._queue_rows_ahead(step)

    def _queue_rows_ahead(self, step: _Launched) -> bool:
        """Queue the decode step after ``step`` for the rows ``_rows_fed_ahead`` gives, where
        each has its next position's block free (``_launch_rows_ahead``); whether it was."""
        rows = self._rows_fed_ahead(step)
        if rows is None or not self._room_ahead([step.seqs[i] for i in rows]):
            return False
        self._ahead = self._launch_rows_ahead(step, rows)
        return True

    def _rows_fed_ahead(self, step: _Launched) -> list[int] | None:
        """The rows of ``step`` (a step whose ids the host has not read) that a step
        queued behind it carries: its sequences that decode again after this token. None
        where there is none, or where the next step must be built on the host: a row with a
        grammar or penalties (their state follows the host's tokens), or a running sequence
        outside ``step`` (resumed after a preemption: its token is on the host)."""
        rows = [i for i, s in enumerate(step.seqs) if not (s.finished or s.cancelled) and self._goes_on(s)]
        if not rows or any(step.seqs[i].matcher is not None or step.seqs[i].params.penalized for i in rows):
            return None
        in_step = {id(s) for s in step.seqs}
        if any(not s.cancelled and id(s) not in in_step for s in self.running):
            return None
        return rows

    def _fed_ids(self, step: _Launched, rows: list[int]) -> torch.Tensor:
        """The ids ``step`` sampled for its ``rows`` (from ``_rows_fed_ahead``), on the device,
        to feed the step queued behind it; all of its rows without an index copied there."""
        return step.tokens if len(rows) == len(step.seqs) else step.tokens[self._rows(rows)]

    def _sampled_rows(self, logits: torch.Tensor, decoded: int, started: list[int]) -> torch.Tensor:
        """The rows of a mixed step's ``logits`` to sample: its ``decoded`` decode rows, then
        the chunks at ``started`` (those that completed a context). (Most steps complete
        none: a slice, not an index copied to the device.)"""
        if not started:
            return logits[:decoded]
        return logits[self._rows(list(range(decoded)) + [decoded + r for r in started])]

    def _goes_on(self, seq: _Sequence) -> bool:
        """Whether ``seq`` decodes again after the token its step in flight samples (not
        ended by length with it)."""
        return len(seq.generated) + 1 < seq.params.max_tokens and seq.next_position + 1 < self.max_seq_len

    def _rows(self, rows: list[int]) -> torch.Tensor:
        """``rows`` as an index on the model's device, queued (a list index would wait for
        the GPU's queued work: ``to_device``)."""
        return to_device(torch.tensor(rows, dtype=torch.long), self.model.device)

    @staticmethod
    def _chunk_inputs(chunks: list[tuple[_Sequence, int, int]],
                      contexts: list[list[int]]) -> tuple[list[int], list[int], list[int], list[int]]:
        """The packed forward's token ids, chunk lengths, rows and first positions."""
        ids = [t for (_, p, n), c in zip(chunks, contexts) for t in c[p:p + n]]
        return ids, [n for _, _, n in chunks], [s.slot for s, _, _ in chunks], [p for _, p, _ in chunks]

    def _prefilled(self, chunks: list[tuple[_Sequence, int, int]],
                   contexts: list[list[int]]) -> tuple[list[_Sequence], list[int]]:
        """Book ``chunks`` as prefilled; the sequences whose context is then complete start
        running: with their first token (returned, with the index of the chunk whose logits
        give it: a request's further choices share its chunk's), or, resumed after a
        preemption, with the token they had."""
        first, rows = [], []
        for i, ((seq, p, n), context) in enumerate(zip(chunks, contexts)):
            seq.prefilled = p + n
            self.kv.commit(seq.kv, context[:seq.prefilled])
            if seq.prefilled < len(context):
                continue
            self.prefilling.remove(seq)
            self.running.append(seq)
            if seq.generated:  # resumed after a preemption: the next step feeds its last token
                if self.history is not None and seq.params.penalized:
                    self.history.resume(seq.slot, seq.prompt_ids, seq.generated)
                continue
            first.append(seq)
            rows.append(i)
            if not seq.forked:  # the request's other choices share this prefill
                seq.forked = True
                for sibling in seq.siblings:
                    sibling.kv = self.kv.fork(seq.kv, len(context), reserve=1)
                    if sibling.kv is None:  # no room now: it waits, to start from the cached prompt
                        self.waiting.appendleft(sibling)
                        continue
                    sibling.slot, sibling.admitted, sibling.prefilled = (sibling.kv.row, next(self._admitted),
                                                                         len(context))
                    sibling.to_prefill = 0  # (the prompt is its first choice's)
                    self.running.append(sibling)
                    first.append(sibling)
                    rows.append(i)
        return first, rows

    def _decode_step(self, prefill_tokens: int) -> bool:
        """One decode step of the running sequences, reported with the ``prefill_tokens``
        prefilled before it, and behind it, before its ids are read, the next step: a decode
        step (look-ahead) or, where a prompt waits, a mixed step. False where none was left
        to decode (nothing reported)."""
        seqs = [s for s in self.running if not s.cancelled]
        ahead, self._ahead = self._ahead, None
        if ahead is not None and not _same(ahead.seqs, seqs):
            self.look_ahead_dropped += 1
            ahead = None
        if ahead is None:
            seqs = self._make_room(seqs)
        if not seqs:
            return False
        step = ahead if ahead is not None else self._launch_step(seqs)
        self.steps += 1
        if self.observer:
            self.observer.on_step(len(seqs), prefill_tokens)
        self._deliver()  # the previous step's events, while the GPU works (module docstring)
        if self._may_look_ahead(step):
            if all(self._goes_on(s) for s in step.seqs):
                if self._room_ahead(step.seqs):
                    self._ahead = self._launch_next_step(step)
            else:  # (some end by length with this token: the step for the others)
                self.look_ahead_partial += self._queue_rows_ahead(step)
        else:  # where a prompt waits, its first chunk goes in a mixed step queued behind this one
            self._queue_mixed(step)
            self.mixed_behind_decode += self._queued is not None
        self._accept_all(seqs, step.token_ids(), step.logprobs)
        return True

    def _make_room(self, seqs: list[_Sequence]) -> list[_Sequence]:
        """A block for each sequence's next position, oldest sequences first; where none is
        free, the newest running sequence is preempted (``_preempt``), until there is one or
        the sequence itself was the newest. The sequences left to decode."""
        for seq in sorted(seqs, key=lambda s: s.admitted):
            while seq.kv is not None and not self.kv.grow(seq.kv, seq.next_position + 1):
                victim = max((s for s in seqs if s.kv is not None), key=lambda s: s.admitted)
                self._preempt(victim)
        self.kv.flush()
        return [s for s in seqs if s.kv is not None]

    def _room_ahead(self, seqs: list[_Sequence]) -> bool:
        """A block for each sequence's position after this step's (a step queued ahead writes
        there), taken only where free: no preemption for a look-ahead."""
        if not all(self.kv.grow(s.kv, s.next_position + 2) for s in seqs):
            return False
        self.kv.flush()
        return True

    def _preempt(self, seq: _Sequence) -> None:
        """Free ``seq``'s blocks and row and queue it first, to be prefilled again from its
        prompt and generated tokens (``_Sequence.context``); its full blocks stay in the
        prefix cache, so that prefill mostly finds them there."""
        self.preemptions += 1
        self.running.remove(seq)
        self.kv.release(seq.kv)
        seq.kv, seq.slot, seq.prefilled = None, -1, 0
        self.waiting.appendleft(seq)
        if self.observer:
            self.observer.on_preempt()
        log.info("KV cache full: preempted %s at %d tokens", seq.request_id, seq.next_position)

    def _launch_step(self, seqs: list[_Sequence]) -> _Launched:
        """Queue one decode step for ``seqs`` from the host's state."""
        dev = self.model.device
        ids = torch.tensor([[s.generated[-1]] for s in seqs], device=dev)
        positions = torch.tensor([[s.next_position] for s in seqs], device=dev)
        slots = torch.tensor([s.slot for s in seqs], device=dev)
        graph = self.graphs is not None
        if graph:
            logits = self.graphs.run(ids, positions, slots)
        elif self.vocab_parallel and self._plain_greedy(seqs):  # (the argmax without gathering the logits)
            return self._queue_tokens(seqs, None, None, graph, self.decode(ids, Decode.at(positions, slots), True))
        else:
            logits = self.decode(ids, Decode.at(positions, slots))
        return self._queue_tokens(seqs, logits, self._batch_sampling(seqs), graph)

    def _launch_next_step(self, step: _Launched) -> _Launched:
        """Queue the step after ``step`` for the same sequences, fed on the device with its ids."""
        logits = self.graphs.run_next(step.tokens)
        sampling = step.sampling.next() if step.sampling is not None else None  # (one token further)
        self.look_ahead_steps += 1
        return self._queue_tokens(step.seqs, logits, sampling, graph=True)

    def _launch_rows_ahead(self, step: _Launched, rows: list[int]) -> _Launched:
        """Queue the decode step after ``step`` (a decode step, or a mixed step:
        ``_queue_decode_behind``) for its ``rows``, the sequences that go on past this token
        (the others end by length with it), fed on the device with the ids ``step``
        sampled: a decode graph's replay for that batch, its positions and rows from
        pinned memory (queued behind ``step``), so that the GPU does not idle while the
        host launches that step after reading ``step``'s ids (docs/design/kv_cache.md,
        "Where a stream's slow gaps come from"). Under tensor parallelism the replay's
        announcement takes the ids to the host (``_LeadingDecodeGraphs.run``), so there
        this waits for ``step`` as before: correct, not ahead."""
        seqs, dev = [step.seqs[i] for i in rows], self.model.device
        ids = self._fed_ids(step, rows).view(-1, 1)
        positions = to_device(torch.tensor([[s.next_position + 1] for s in seqs]), dev)
        slots = to_device(torch.tensor([s.slot for s in seqs]), dev)
        if self.graphs is not None:
            logits = self.graphs.run(ids, positions, slots)
        else:  # (behind a mixed step without decode graphs: the CPU, where it runs as called)
            logits = self.decode(ids, Decode.at(positions, slots))
        self.look_ahead_steps += 1
        return self._queue_tokens(seqs, logits, self._batch_sampling(seqs, ahead=len(seqs)),
                                  graph=self.graphs is not None)

    def _may_look_ahead(self, step: _Launched) -> bool:
        """Whether the step after ``step`` is known now to decode (those of) its sequences (that
        go on past this token) by a graph replay."""
        if not step.graph:  # (a graph replay: CUDA, graphs captured)
            return False
        if self.prefilling or self._may_admit():  # a newcomer is prefilled first
            return False
        # (a grammar's next mask needs this step's token)
        return not any(s.matcher is not None for s in step.seqs)

    def _may_admit(self) -> bool:
        """Whether the head of the queue may be admitted at the next iteration (a row and
        its context's blocks free, cached prefixes not counted)."""
        if not self.waiting or len(self.running) + len(self.prefilling) >= self.max_num_seqs:
            return False
        return self.kv.pool.num_free >= self.kv.blocks_for(len(self.waiting[0].context()) + 1)

    @staticmethod
    def _plain_greedy(seqs: list[_Sequence]) -> bool:
        """Whether every row's next token is its logits' argmax (no processor, no log-probabilities)."""
        return all(s.params.greedy and not s.params.processed and s.params.logprobs is None for s in seqs)

    def _batch_sampling(self, seqs: list[_Sequence], ahead: int = 0) -> BatchSampling | None:
        """The rows' sampling on the device; None where every row is plain greedy (nothing
        to ship: the draw is an argmax). The first ``ahead`` rows draw one token further
        than the host has them."""
        if self._plain_greedy(seqs):
            return None
        p = [s.params for s in seqs]
        if self.history is None and any(x.penalized for x in p):
            self.history = TokenHistory(self.cache.num_rows, self.max_seq_len, self.model.cfg.vocab_size,
                                        self.model.device)
        # (called once the step's forward is queued: the grammars' masks are filled while it runs)
        masks = self.grammars.masks([s.matcher for s in seqs]) if any(s.matcher is not None for s in seqs) else None
        steps = [len(s.generated) + (i < ahead) for i, s in enumerate(seqs)]
        return BatchSampling.of(p, [s.seed for s in seqs], steps, [s.slot for s in seqs], self.eos, self.model.device,
                                masks)

    def _queue_tokens(self, seqs: list[_Sequence], logits: torch.Tensor | None, sampling: BatchSampling | None,
                      graph: bool, tokens: torch.Tensor | None = None) -> _Launched:
        """Sample ``logits`` on the device (or take the model's greedy ``tokens``) and queue
        the ids' (and log-probabilities') copy to the host."""
        logprobs = None
        if tokens is None and sampling is None:
            tokens = greedy(logits)
        elif tokens is None:
            tokens, logprobs = sampling.draw(logits, self.history if sampling.needs_history else None)
        host = ready = None
        if logprobs is not None:
            logprobs = logprobs.to_host()
        if self._pinned:
            host = self._pinned[self._pinned_next]
            self._pinned_next ^= 1
            host[: len(seqs)].copy_(tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        return _Launched(seqs, tokens, host, ready, sampling, graph, logprobs)

    def _emit_tokens(self, seqs: list[_Sequence], logits: torch.Tensor, started: list[_Sequence]) -> None:
        """Sample a token for each of ``seqs`` from its row of ``logits`` and accept them;
        ``started``: those of them sampling their first token."""
        step = self._sample(seqs, logits, started)
        self._deliver()  # the previous step's events, while this step's kernels run
        self._accept_all(seqs, step.token_ids(), step.logprobs)

    def _sample(self, seqs: list[_Sequence], logits: torch.Tensor, started: list[_Sequence],
                ahead: int = 0) -> _Launched:
        """Queue the sampling of a token for each of ``seqs`` from its row of ``logits``;
        ``started``: those of them sampling their first token; the first ``ahead`` of them
        one token further than the host has them (a step queued ahead)."""
        sampling = self._batch_sampling(seqs, ahead)
        for seq in started:
            if seq.params.repetition_penalty != 1.0:  # (the repetition penalty counts the prompt too)
                self.history.start(seq.slot, seq.prompt_ids)
        return self._queue_tokens(seqs, logits, sampling, graph=False)

    def _accept_all(self, seqs: list[_Sequence], tokens: list[int], logprobs: Logprobs | None = None) -> int:
        """Accept each sequence's token; a sequence that has ended since its step was queued
        (a mixed step queued ahead: ``_queued_step``) had a row too many, dropped. Returns
        the rows dropped."""
        now, dropped = time.perf_counter(), 0
        for i, (seq, tok) in enumerate(zip(seqs, tokens)):
            if seq.finished:
                dropped += 1
                continue
            k = seq.params.logprobs
            self._accept(seq, tok, now, None if k is None else [logprobs.row(i, k, tok)])
        return dropped

    def _accept(self, seq: _Sequence, token: int, now: float, logprobs: list[TokenLogprob] | None = None) -> None:
        if self.observer:
            if seq.generated:
                self.observer.on_token_latency(now - seq.last_token_time)
            else:
                self.observer.on_first_token(now - seq.submitted)
        seq.last_token_time = now
        seq.generated.append(token)
        if self.kv.pool.prefix_caching and seq.kv is not None and seq.next_position % self.cache.block_size == 0:
            # (a block was completed: positions up to next_position are written)
            self.kv.commit(seq.kv, (seq.prompt_ids + seq.generated)[:seq.next_position])
        if seq.matcher is not None and not seq.matcher.consume_token(token):
            self._finish(seq, "error", error=f"the grammar refused a token: {seq.matcher.get_error()}")
            return
        if (token in self.eos and not seq.params.ignore_eos) or token in seq.params.stop_token_ids:
            self._finish(seq, "stop", token_ids=[token])  # (not part of the text: no log-probability either)
            return
        text = seq.stream.add(token) if seq.stream is not None else ""
        if (seq.stream is not None and seq.stream.stopped) or (seq.matcher is not None and seq.matcher.is_stopped()):
            self._finish(seq, "stop", text=text, token_ids=[token], logprobs=logprobs)
        elif len(seq.generated) >= seq.params.max_tokens or seq.next_position >= self.max_seq_len:
            self._finish(seq, "length", text=text, token_ids=[token], logprobs=logprobs)
        else:
            self._outbox.append((seq.sink, StreamEvent(text, [token], logprobs=logprobs)))

    def _finish(self, seq: _Sequence, reason: str, text: str = "", token_ids: list[int] | None = None,
                error: str | None = None, logprobs: list[TokenLogprob] | None = None) -> None:
        if seq.finished:
            return
        seq.finished = True
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        if seq.kv is not None:
            self.kv.release(seq.kv)
            seq.kv, seq.slot = None, -1
        head = seq.head or seq
        if all(s.finished for s in (head, *head.siblings)):  # (a cancel reaches every choice until the last ends)
            self.by_id.pop(head.request_id, None)
        if reason != "error" and reason != "abort" and seq.stream is not None:
            text += seq.stream.finish()
        n_out = len(seq.generated)
        if self.pacing is not None and reason in ("stop", "length"):
            self.pacing.finished(n_out)
        if self.observer:
            self.observer.on_finish(reason, len(seq.prompt_ids), n_out, time.perf_counter() - seq.submitted)
        self._outbox.append((seq.sink, StreamEvent(text, token_ids or [], reason, len(seq.prompt_ids), n_out, error,
                                                   logprobs)))
        if not seq.forked:  # choices not started yet (the prompt still prefilling) end with it
            for sibling in seq.siblings:
                self._finish(sibling, reason, error=error)
