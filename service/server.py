"""Wiring: load the model, start the engine, attach metrics, run uvicorn."""
from __future__ import annotations

import gc
import logging
import os
import socket
import sys
import time

import torch
import uvicorn

from ..engine.engine import Engine
from ..engine.tensor_parallel import follow
from ..kernels.build import source_hash
from ..kernels.observe import KernelTiming
from ..kernels.timing import copy_bandwidth
from ..models.config import ArchConfig
from ..models.loader import LoadedModel, load_model, read_config
from ..models.sharding import check_split
from .app import ServerState, create_app
from .config import ModelSettings, ServeSettings
from .http_guard import HttpGuard, h11_protocol
from .logs import setup_logging
from .metrics import Metrics
from .ranks import Ranks, start_ranks

log = logging.getLogger("woq.service")


def eos_token_ids(loaded: LoadedModel) -> set[int]:
    """EOS ids from the tokenizer, the model config and, when present, generation_config."""
    ids: set[int] = set()

    def add(v) -> None:
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(x for x in v if isinstance(x, int))

    add(getattr(loaded.tokenizer, "eos_token_id", None))
    add(getattr(loaded.hf_config, "eos_token_id", None))
    path = getattr(loaded.hf_config, "_name_or_path", None)
    if path and os.path.isfile(os.path.join(path, "generation_config.json")):
        from transformers import GenerationConfig

        add(GenerationConfig.from_pretrained(path, local_files_only=True).eos_token_id)
    return ids


def load(settings: ModelSettings, progress: bool = True, ranks: Ranks | None = None) -> LoadedModel:
    """The model ``settings`` name; with ``ranks``, this rank's shard of it on its device."""
    device, tp = (settings.device, None) if ranks is None else (ranks.device, ranks.tp)
    return load_model(settings.model, settings.quant_config(), settings.torch_dtype(), device,
                      settings.max_seq_len, progress=progress, options=settings.runtime_options(), tp=tp)


def build_state(settings: ServeSettings, loaded: LoadedModel | None = None, ranks: Ranks | None = None) -> ServerState:
    """The server's engine, metrics and settings (``ranks``: rank 0 of a tensor-parallel group)."""
    loaded = loaded or load(settings)
    if settings.chat_template is not None:
        try:
            loaded.tokenizer.chat_template = settings.chat_template.read_text()
        except OSError as e:
            raise SystemExit(f"cannot read --chat-template {settings.chat_template}: {e.strerror or e}") from e
    metrics = Metrics()
    model = loaded.model
    # (observed before the engine captures its graphs: a graph's calls are recorded as it is captured)
    timing = KernelTiming(metrics, settings.kernel_timing_every)
    model.observe_kernels(timing)
    on_cuda = model.device.type == "cuda"
    metrics.bind_timing(timing, copy_bandwidth(model.device, settings.runtime_options().cache_dir) if on_cuda else None)
    device = torch.cuda.get_device_name(model.device) if on_cuda else "cpu"
    metrics.describe(settings.served_model_name or loaded.name, loaded.quantization, device, source_hash())
    budget = {"max_prefill_tokens": settings.max_prefill_tokens} if settings.max_prefill_tokens else {}
    engine = Engine(model, loaded.tokenizer, eos_token_ids(loaded), max_num_seqs=settings.max_num_seqs,
                    max_queue=settings.max_queue, max_seq_len=settings.max_seq_len, observer=metrics,
                    cuda_graphs=settings.cuda_graphs, prefill_graphs=settings.prefill_graphs,
                    gpu_memory_fraction=settings.gpu_memory_fraction, kv_cache_gib=settings.kv_cache_gib,
                    block_size=settings.block_size, prefix_caching=settings.prefix_caching,
                    mixed_step_ratio=settings.mixed_step_ratio, mirror=None if ranks is None else ranks.leader,
                    **budget).start()
    metrics.bind_engine(engine)
    return ServerState(engine, loaded.tokenizer, settings.served_model_name or loaded.name, metrics,
                       api_key=settings.api_key, max_body_bytes=settings.max_body_bytes,
                       request_timeout=settings.request_timeout)


class PortInUseError(OSError):
    """The address ``woq serve`` was asked to listen on cannot be bound."""


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound now -- before the model loads, so that a busy
    port is reported at once rather than after minutes of loading. uvicorn serves on it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn binds: TIME_WAIT is no conflict)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise PortInUseError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn, draining before it shuts down. uvicorn's shutdown closes the listening
    socket first, so during its wait for in-flight requests new clients would get
    "connection refused". Here SIGTERM/SIGINT first sets ``state.draining`` while
    everything keeps serving: /health and new generation requests get 503 (with
    ``Connection: close``: ``HttpGuard``), and the requests in flight at the signal,
    streams included, run to their end. When they have all ended, or ``drain_timeout``
    has passed, uvicorn's own shutdown follows with what is left of the time: it closes
    the socket, waits for the responses still being written, and runs the app's lifespan
    shutdown (the engine stops). A second signal skips the rest of the drain."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float):
        super().__init__(config)
        self.state, self.drain_timeout = state, drain_timeout
        self.drain_signal: int | None = None
        self.drain_deadline = 0.0
        self.in_flight: set | None = None  # the request tasks running when the drain began

    def handle_exit(self, sig, frame):
        # (a signal handler: it only records the signal; on_tick does the rest, on the loop)
        if self.drain_signal is None:
            self.drain_signal, self.drain_deadline = sig, time.monotonic() + self.drain_timeout
            self.state.draining = True
        elif not self.should_exit:
            self._shut_down(sig)
        else:
            super().handle_exit(sig, frame)  # (uvicorn's: a further Ctrl+C stops waiting at all)

    async def on_tick(self, counter: int) -> bool:
        # (uvicorn's main loop calls this every 0.1 s; when it returns True, uvicorn shuts down)
        if self.drain_signal is not None and not self.should_exit:
            if self.in_flight is None:
                self.in_flight = set(self.server_state.tasks)
                log.info("draining: waiting up to %g s for %d requests in flight (%d running and %d queued in the "
                         "engine)", self.drain_timeout, len(self.in_flight), self.state.engine.num_running,
                         self.state.engine.num_waiting)
            self.in_flight = {t for t in self.in_flight if not t.done()}
            if not self.in_flight:
                self._shut_down(self.drain_signal)
            elif time.monotonic() >= self.drain_deadline:
                log.warning("drain timeout: %d requests still in flight are cut off", len(self.in_flight))
                self._shut_down(self.drain_signal)
        return await super().on_tick(counter)

    def _shut_down(self, sig: int) -> None:
        # uvicorn waits timeout_graceful_shutdown for the connections still open: the rest
        # of the drain's time (a little at least, for responses whose last bytes are queued)
        self.config.timeout_graceful_shutdown = max(self.drain_deadline - time.monotonic(), 0.5)
        super().handle_exit(sig, None)  # (uvicorn re-raises the signal once stopped: exit status 128 + signal)


# How long a Python thread may hold the GIL while another waits for it (CPython's default:
# 5 ms). The engine thread and the event loop share the GIL: back from waiting on the
# GPU, the engine thread must get it to launch the next step, and with the default a busy
# event loop (streaming a batch's tokens) can keep it for 5 ms each time -- a step's worth
# of GPU idling (docs/design/serving.md, "The GIL between the engine and the event loop").
GIL_SWITCH_SECONDS = 0.0002


def freeze_heap() -> None:
    """Move every object alive after start-up (the model's modules, torch, transformers,
    the tokenizer: hundreds of thousands) out of the garbage collector's reach. A full
    collection otherwise walks them all while every thread of the process waits, the
    engine's between two steps included, and streaming's garbage triggers one every so
    often: a stall of every stream (docs/design/serving.md, "Garbage collection"). Frozen,
    a full collection walks only what was made since; that is collected as before."""
    gc.collect()
    gc.freeze()


def serve(settings: ServeSettings) -> None:
    sys.setswitchinterval(GIL_SWITCH_SECONDS)
    setup_logging(settings.log_level, settings.log_format)
    follower = settings.tensor_parallel_size > 1 and os.environ.get("RANK", "0") != "0"  # (started by a launcher)
    sock = None if follower else listen(settings.host, settings.port)
    if settings.tensor_parallel_size > 1:  # (every rank alike: none is left waiting for one that refused)
        check_split(ArchConfig.from_hf(read_config(settings.model, settings.cache)), settings.tensor_parallel_size)
    ranks = start_ranks(settings) if settings.tensor_parallel_size > 1 else None
    if ranks is not None and ranks.rank > 0:  # (HTTP and the engine are rank 0's)
        try:
            model = load(settings, progress=False, ranks=ranks).model
            freeze_heap()  # (a follower's pause stalls every rank's step)
            follow(model, ranks.channel)
        finally:
            ranks.close()
        return
    try:
        loaded = load(settings, ranks=ranks)
        log.info("loaded %s (%s) on %s in %.1f s%s", loaded.name, loaded.quantization, loaded.model.device,
                 loaded.load_seconds, ", from the quantized-model cache" if loaded.from_cache else "")
        state = build_state(settings, loaded, ranks)
    except BaseException:
        if ranks is not None:
            for child in ranks.children:
                child.kill()
        raise
    app = HttpGuard(create_app(state), state, settings.body_timeout)
    if ranks is not None:
        ranks.watch_children()
    freeze_heap()
    # h11 always (uvicorn's default unless httptools is installed): the header timeout is
    # built on its connection class
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None,
                            log_level=settings.log_level, http=h11_protocol(settings.header_timeout),
                            timeout_graceful_shutdown=settings.drain_timeout)
    try:
        DrainingServer(config, state, settings.drain_timeout).run(sockets=[sock])
    finally:
        state.engine.shutdown()
        if ranks is not None:
            ranks.close()
