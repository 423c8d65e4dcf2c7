"""Wiring: load the model, start the engine, attach metrics, run uvicorn."""
from __future__ import annotations

import logging
import os
import socket

import torch

from ..engine.engine import Engine
from ..kernels.build import source_hash
from ..kernels.observe import KernelTiming
from ..kernels.timing import copy_bandwidth
from ..models.loader import LoadedModel, load_model
from .app import ServerState, create_app
from .config import ModelSettings, ServeSettings
from .logs import setup_logging
from .metrics import Metrics

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


def load(settings: ModelSettings, progress: bool = True) -> LoadedModel:
    return load_model(settings.model, settings.quant_config(), settings.torch_dtype(), settings.device,
                      settings.max_seq_len, progress=progress, options=settings.runtime_options())


def build_state(settings: ServeSettings, loaded: LoadedModel | None = None) -> ServerState:
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
    engine = Engine(model, loaded.tokenizer, eos_token_ids(loaded), max_batch_size=settings.max_batch_size,
                    max_queue=settings.max_queue, max_seq_len=settings.max_seq_len,
                    max_prefill_tokens=settings.max_prefill_tokens, observer=metrics, cuda_graphs=settings.cuda_graphs,
                    prefill_graphs=settings.prefill_graphs, gpu_memory_fraction=settings.gpu_memory_fraction).start()
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


def serve(settings: ServeSettings) -> None:
    import uvicorn

    setup_logging(settings.log_level, settings.log_format)
    sock = listen(settings.host, settings.port)
    loaded = load(settings)
    log.info("loaded %s (%s) on %s in %.1f s%s", loaded.name, loaded.quantization, loaded.model.device,
             loaded.load_seconds, ", from the quantized-model cache" if loaded.from_cache else "")
    state = build_state(settings, loaded)

    class DrainingServer(uvicorn.Server):
        """On SIGTERM/SIGINT: /health turns 503 and new requests get 503 at once, while
        uvicorn stops accepting connections and waits up to --drain-timeout for the
        in-flight ones (streams included) to finish."""

        def handle_exit(self, sig, frame):
            if not state.draining:
                log.info("draining: waiting up to %.0f s for %d running and %d queued requests",
                         settings.drain_timeout, state.engine.num_running, state.engine.num_waiting)
            state.draining = True
            super().handle_exit(sig, frame)

    config = uvicorn.Config(create_app(state), host=settings.host, port=settings.port, log_config=None,
                            log_level=settings.log_level, timeout_graceful_shutdown=settings.drain_timeout)
    try:
        DrainingServer(config).run(sockets=[sock])  # on a signal, uvicorn re-raises it once drained: 128 + signal
    finally:
        state.engine.shutdown()
