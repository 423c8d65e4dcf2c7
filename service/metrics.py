"""Prometheus metrics (``woq_*``), fed by the HTTP layer, the engine and the model's
kernel plans.

Each server owns a registry (several servers can live in one test process). The README
lists every metric with its unit and labels.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from ..kernels.observe import KernelCall, m_bucket

# Buckets sized for LLM serving: first tokens take 10 ms (small model, short prompt) to
# tens of seconds (queued behind long prefills); inter-token gaps 1 ms (GPU decode) to
# ~1 s (CPU, large batch); kernels 1 µs (GPU GEMV) to ~100 ms (CPU prefill matmul).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
KERNEL_BUCKETS = (1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.25)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    """Implements ``engine.EngineObserver`` and ``kernels.observe.KernelObserver``."""

    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
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
        self.running = Gauge("woq_requests_running", "Requests holding a KV slot (decoding)", registry=r)
        self.waiting = Gauge("woq_requests_waiting", "Requests queued for a KV slot", registry=r)
        self.batch_size = Histogram("woq_batch_size", "Sequences per decode step", buckets=BATCH_BUCKETS, registry=r)
        self.prefill_tokens = Counter("woq_prefill_tokens", "Prompt tokens prefilled between decode steps", registry=r)
        labels = ["path", "layer", "bits", "m_bucket"]
        self.kernel_latency = Histogram("woq_kernel_latency_seconds",
                                        "Latency of sampled quantized-linear calls by dispatch path",
                                        labels, buckets=KERNEL_BUCKETS, registry=r)
        self.kernel_calls = Counter("woq_kernel_calls", "Linear-layer calls by dispatch path", labels, registry=r)
        self._children: dict[tuple, tuple] = {}

    def bind_engine(self, engine) -> None:
        """Gauges read straight from the engine (and the GPU) at scrape time."""
        r = self.registry
        self.running.set_function(lambda: engine.num_running)
        self.waiting.set_function(lambda: engine.num_waiting)
        Gauge("woq_kv_cache_slots", "KV cache slots (sequences that can decode together)",
              registry=r).set_function(lambda: engine.max_batch_size)
        Gauge("woq_kv_cache_tokens", "Tokens held in the KV cache by running requests",
              registry=r).set_function(lambda: engine.kv_tokens_in_use)
        Gauge("woq_kv_cache_usage_ratio", "KV cache positions in use / positions allocated",
              registry=r).set_function(lambda: engine.kv_tokens_in_use / (engine.max_batch_size * engine.max_seq_len))
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
        self.batch_size.observe(batch_size)
        if prefill_tokens:
            self.prefill_tokens.inc(prefill_tokens)

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_token_latency(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def on_finish(self, finish_reason: str, prompt_tokens: int, completion_tokens: int, seconds: float) -> None:
        self.e2e.labels(finish_reason).observe(seconds)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)

    # -- KernelObserver ------------------------------------------------------------------
    def record(self, call: KernelCall, seconds: float | None) -> None:
        key = (call.path, call.layer, call.bits, call.m)
        children = self._children.get(key)
        if children is None:  # label lookups cost more than the observation: cache them
            labels = (call.path, call.layer, str(call.bits), m_bucket(call.m))
            children = self._children[key] = (self.kernel_calls.labels(*labels), self.kernel_latency.labels(*labels))
        children[0].inc()
        if seconds is not None:
            children[1].observe(seconds)
