"""Prometheus metrics (``woq_*``), fed by the HTTP layer, the engine and the model's
kernel plans.

Each server owns a registry (several servers can live in one test process). The README
lists every metric with its unit and labels.
"""
from __future__ import annotations

import threading
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..kernels.observe import KernelCall, KernelTiming, m_bucket

# Buckets sized for LLM serving: first tokens take 10 ms (small model, short prompt) to
# tens of seconds (queued behind long prefills); inter-token gaps 1 ms (GPU decode) to
# ~1 s (CPU, large batch); kernels 2 µs (a small GPU GEMV or a decode step's stage) to
# ~100 ms (a CPU prefill matmul).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
KERNEL_BUCKETS = (2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3, 2e-2, 0.1)
# The achieved-bandwidth gauges: bytes and seconds of each series' last samples.
ROOFLINE_WINDOW = 64
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Prompt tokens a step carries: a paced chunk (16 up) to a whole budget (--max-prefill-tokens:
# 512 by default, and it may be set higher).
STEP_PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# An engine iteration: a GPU decode step of an 8B model takes 2-12 ms, a step with a
# 512-token prompt chunk ~20 ms; CPU iterations 50 ms to seconds.
ITERATION_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """Implements ``engine.EngineObserver`` and ``kernels.observe.KernelObserver``."""

    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        # No `_created` series: a Unix time per counter and histogram series, which no
        # panel reads and which doubles the counters' lines (a setting of the library).
        disable_created_metrics()
        self._timings: list[KernelTiming] = []
        # (first: collectors are scraped in the order they registered)
        r.register(_FlushBeforeScrape(self._timings))
        ProcessCollector(registry=r)  # process_* (RSS, CPU seconds): the CPU memory panel
        self.requests = Counter("woq_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("woq_time_to_first_token_seconds", "Time from request to first generated token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("woq_inter_token_latency_seconds", "Time between consecutive generated tokens",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("woq_request_latency_seconds", "Time from request to its last token",
                             ["finish_reason"], buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("woq_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("woq_generation_tokens", "Tokens generated", registry=r)
        self.running = Gauge("woq_requests_running", "Requests holding KV blocks (prefilling or decoding)", registry=r)
        self.waiting = Gauge("woq_requests_waiting", "Requests queued for KV blocks", registry=r)
        self.batch_size = Histogram("woq_batch_size", "Sequences decoded per step", buckets=BATCH_BUCKETS, registry=r)
        self.prefill_tokens = Counter("woq_prefill_tokens", "Prompt tokens prefilled", registry=r)
        self.step_prompt_tokens = Histogram("woq_step_prompt_tokens",
                                            "Prompt tokens per engine step that prefilled any (a mixed step's chunks, "
                                            "or a prefill between decode steps)", buckets=STEP_PROMPT_BUCKETS,
                                            registry=r)
        self.iteration = Histogram("woq_engine_iteration_seconds", "Wall time of an engine iteration by kind: "
                                   "decode, mixed (decode tokens and prompt chunks) or prefill (prompt chunks alone)",
                                   ["kind"], buckets=ITERATION_BUCKETS, registry=r)
        self.preemptions = Counter("woq_preemptions", "Sequences preempted for KV blocks (recomputed later)",
                                   registry=r)
        labels = ["path", "layer", "bits", "m_bucket"]
        self.kernel_latency = Histogram("woq_kernel_latency_seconds",
                                        "Latency of sampled quantized-linear calls by dispatch path",
                                        labels, buckets=KERNEL_BUCKETS, registry=r)
        self.kernel_calls = Counter("woq_kernel_calls", "Linear-layer calls by dispatch path", labels, registry=r)
        self.step_roofline = Gauge("woq_decode_step_roofline_ratio",
                                   "Weight bytes a sampled decode step reads per second of it, as a fraction of the "
                                   "GPU's measured copy bandwidth", ["batch"], registry=r)
        self.info = Gauge("woq_build_info", "The served model, its quantization, the device and the kernels' version "
                          "(value 1)", ["model", "quant", "device", "kernel_version"], registry=r)
        self._children: dict[tuple, tuple] = {}
        # the sampled calls' (bytes, seconds) by (path, layer kind): appended on the engine's
        # thread, read at a scrape (the lock: a deque must not change while it is read)
        self._window: dict[tuple[str, str], deque] = {}
        self._window_lock = threading.Lock()
        r.register(_RooflineCollector(self))
        self.bandwidth: float | None = None  # bytes/s of a device-to-device copy (the roofline gauges)

    def bind_timing(self, timing: KernelTiming, bandwidth: float | None) -> None:
        """Add ``timing``'s graph replays to the counts at each scrape; ``bandwidth``: the
        copy bandwidth the roofline gauges divide by (None: no such gauges)."""
        self._timings.append(timing)
        self.bandwidth = bandwidth

    def describe(self, model: str, quant: str, device: str, kernel_version: str) -> None:
        self.info.labels(model, quant, device, kernel_version).set(1)

    def bind_engine(self, engine) -> None:
        """Gauges read straight from the engine (and the GPU) at scrape time."""
        r = self.registry
        self.running.set_function(lambda: engine.num_running)
        self.waiting.set_function(lambda: engine.num_waiting)
        Gauge("woq_kv_cache_blocks", "KV cache blocks in the pool", registry=r).set(engine.kv_blocks_total)
        Gauge("woq_kv_cache_block_size", "Positions per KV cache block", registry=r).set(engine.cache.block_size)
        Gauge("woq_kv_cache_blocks_used", "KV cache blocks held by running or prefilling requests",
              registry=r).set_function(lambda: engine.kv_blocks_used)
        Gauge("woq_kv_cache_usage_ratio", "KV cache blocks held / blocks in the pool",
              registry=r).set_function(lambda: engine.kv_blocks_used / engine.kv_blocks_total)
        pool = engine.kv.pool
        r.register(_PrefixCacheCollector(pool))
        Gauge("woq_prefix_cache_hit_ratio", "Prompt tokens found in the prefix cache / prompt tokens looked up",
              registry=r).set_function(lambda: pool.hit_tokens / max(pool.query_tokens, 1))
        Gauge("woq_kv_cache_bytes", "Bytes allocated to the KV cache", registry=r).set(engine.cache.nbytes())
        device = engine.model.device
        if device.type == "cuda":
            import torch

            Gauge("woq_gpu_memory_allocated_bytes", "GPU memory held by tensors",
                  registry=r).set_function(lambda: torch.cuda.memory_allocated(device))
            Gauge("woq_gpu_memory_reserved_bytes", "GPU memory reserved by the caching allocator",
                  registry=r).set_function(lambda: torch.cuda.memory_reserved(device))
            Gauge("woq_gpu_memory_total_bytes", "GPU memory of the device",
                  registry=r).set(torch.cuda.get_device_properties(device).total_memory)

    # -- EngineObserver ------------------------------------------------------------------
    def on_step(self, batch_size: int, prefill_tokens: int) -> None:
        if batch_size:
            self.batch_size.observe(batch_size)
        if prefill_tokens:
            self.prefill_tokens.inc(prefill_tokens)
            self.step_prompt_tokens.observe(prefill_tokens)

    def on_iteration(self, kind: str, seconds: float) -> None:
        self.iteration.labels(kind).observe(seconds)

    def on_preempt(self) -> None:
        self.preemptions.inc()

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.generation_tokens.inc()

    def on_token_latency(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.generation_tokens.inc()

    def on_finish(self, finish_reason: str, prompt_tokens: int, completion_tokens: int, seconds: float) -> None:
        self.e2e.labels(finish_reason).observe(seconds)
        self.prompt_tokens.inc(prompt_tokens)

    # -- KernelObserver ------------------------------------------------------------------
    def _series(self, call: KernelCall) -> tuple:
        key = (call.path, call.layer, call.bits, call.m)
        children = self._children.get(key)
        if children is None:  # label lookups cost more than the observation: cache them
            labels = (call.path, call.layer, str(call.bits), m_bucket(call.m))
            children = self._children[key] = (self.kernel_calls.labels(*labels), self.kernel_latency.labels(*labels))
        return children

    def count(self, call: KernelCall, calls: int) -> None:
        self._series(call)[0].inc(calls)

    def time(self, call: KernelCall, seconds: float) -> None:
        """One sampled call: its histogram, and its (bytes, seconds) in its series' window
        for the roofline gauges, which are worked out at a scrape (``_RooflineCollector``):
        a timed persistent step reports every stage of every layer at once, on the engine's
        thread, where any work per sample delays the next step's launch (docs/design/metrics.md)."""
        self._series(call)[1].observe(seconds)
        moved = call.bytes_moved()
        if self.bandwidth and moved and seconds > 0:
            key = (call.path, call.layer)
            with self._window_lock:
                window = self._window.get(key)
                if window is None:
                    window = self._window[key] = deque(maxlen=ROOFLINE_WINDOW)
                window.append((moved, seconds))

    def roofline_windows(self) -> dict[tuple[str, str], tuple[tuple[int, float], ...]]:
        """A copy of the windows: {(path, layer kind): ((bytes, seconds), ...)}."""
        with self._window_lock:
            return {key: tuple(w) for key, w in self._window.items()}

    def record_step(self, batch: int, seconds: float, weight_bytes: int) -> None:
        if self.bandwidth and seconds > 0:
            self.step_roofline.labels(str(batch)).set(weight_bytes / seconds / self.bandwidth)


class _RooflineCollector(Collector):
    """The achieved-bandwidth gauges, from the windows of sampled calls at each scrape.
    A kernel path and layer kind: the window's bytes over its seconds. A decoder layer: a
    layer calls each kind once, so its figure weighs the kinds equally (each kind's mean
    bytes over the sum of their mean seconds), whatever order and rate they were sampled
    in. Under programmatic launches a kernel's first weight loads run in the time of the
    kernel before it; where that is another GEMV of the layer (down's in gate_up's), the
    time moves between the kinds' gauges and stays in the layer's (docs/design/metrics.md)."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def collect(self):
        kernel = GaugeMetricFamily("woq_kernel_roofline_ratio",
                                   "Bytes a kernel path must move per second of its sampled calls, as a fraction of "
                                   "the GPU's measured copy bandwidth", labels=["path", "layer"])
        layer = GaugeMetricFamily("woq_decoder_layer_roofline_ratio",
                                  "Bytes one call of each layer kind of a kernel path must move per second of those "
                                  "calls (each kind's sampled mean), as a fraction of the GPU's measured copy "
                                  "bandwidth", labels=["path"])
        bandwidth = self.metrics.bandwidth
        windows = self.metrics.roofline_windows() if bandwidth else {}  # (no bandwidth: no gauges)
        means: dict[str, list[tuple[float, float]]] = {}  # path: each layer kind's mean (bytes, seconds)
        for (path, kind), window in windows.items():
            bytes_, seconds = sum(b for b, _ in window), sum(t for _, t in window)
            kernel.add_metric([path, kind], bytes_ / seconds / bandwidth)
            if kind != "lm_head":
                means.setdefault(path, []).append((bytes_ / len(window), seconds / len(window)))
        for path, kinds in means.items():
            layer.add_metric([path], sum(b for b, _ in kinds) / sum(t for _, t in kinds) / bandwidth)
        yield kernel
        yield layer


class _FlushBeforeScrape(Collector):
    """Registered before the kernel counters' first scrape: adds the graph replays counted
    since the last scrape (``KernelTiming.flush``), and exports nothing itself."""

    def __init__(self, timings: list[KernelTiming]):
        self.timings = timings

    def collect(self):
        for timing in self.timings:
            timing.flush()
        return []


class _PrefixCacheCollector(Collector):
    """The prefix cache's token counts, read from the engine's block pool at scrape time
    (the pool counts them where it looks prefixes up)."""

    def __init__(self, pool):
        self.pool = pool

    def collect(self):
        queries = CounterMetricFamily("woq_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache")
        queries.add_metric([], self.pool.query_tokens)
        hits = CounterMetricFamily("woq_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache")
        hits.add_metric([], self.pool.hit_tokens)
        return [queries, hits]
