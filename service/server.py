"""Wiring: load the model, start the engine, attach metrics, run uvicorn."""
from __future__ import annotations

import logging
import os
import sys

from ..engine.engine import Engine
from ..models import dispatch
from ..models.loader import LoadedModel, load_model
from .app import ServerState, create_app
from .config import ModelSettings, ServeSettings
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
    os.environ["WOQ_CACHE"] = str(settings.cache)
    return load_model(settings.model, settings.quant_config(), settings.torch_dtype(), settings.device,
                      settings.max_seq_len, progress=progress)


def build_state(settings: ServeSettings, loaded: LoadedModel | None = None) -> ServerState:
    loaded = loaded or load(settings)
    metrics = Metrics()
    engine = Engine(loaded.model, loaded.tokenizer, eos_token_ids(loaded), max_batch_size=settings.max_batch_size,
                    max_queue=settings.max_queue, max_seq_len=settings.max_seq_len,
                    max_prefill_tokens=settings.max_prefill_tokens, observer=metrics).start()
    metrics.bind_engine(engine)
    dispatch.set_observer(metrics, sample_every=settings.kernel_timing_every)
    return ServerState(engine, loaded.tokenizer, settings.served_model_name or loaded.name, metrics)


def serve(settings: ServeSettings) -> None:
    import uvicorn

    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    loaded = load(settings)
    log.info("loaded %s (%s) on %s in %.1f s", loaded.name, settings.quant_config().describe(),
             loaded.model.device, loaded.load_seconds)
    state = build_state(settings, loaded)
    app = create_app(state)
    try:
        uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level)
    finally:
        state.engine.shutdown()
