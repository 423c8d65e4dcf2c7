"""Shared fixtures: tiny random HF checkpoints, the real SmolLM2, a live server."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def tiny_hf_checkpoint(tmp: Path, model_type: str = "llama", **overrides) -> Path:
    """Save a tiny random HF model (config + safetensors + a copy of SmolLM2's tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-5, tie_word_embeddings=False)
    base.update(overrides)
    config = AutoConfig.for_model(model_type, **base)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init gives near-uniform logits (argmax ties); scale up so greedy is decisive.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    out = tmp / f"tiny-{model_type}"
    model.save_pretrained(out)
    return out


def random_llama(dtype: torch.dtype, device: str, max_seq_len: int, quant: str = "int4",
                 symmetric: bool | None = None, options=None, **overrides):
    """Our ``CausalLM`` for a random-weight Llama config (no files, no tokenizer): for GPU
    tests that need real shapes rather than a real model. ``symmetric``: the quantization's
    (None: the mode's default); ``options``: the ``RuntimeOptions`` it is built with."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from woq.models.builder import build_model
    from woq.models.quant_config import QuantConfig

    base = dict(vocab_size=512, hidden_size=256, intermediate_size=640, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=max_seq_len, rms_norm_eps=1e-5, tie_word_embeddings=False)
    base.update(overrides)
    config = LlamaConfig(**base)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    state = {k: torch.ones(s) if k.endswith("norm.weight") else 0.08 * torch.randn(s, generator=g)
             for k, s in shapes.items()}
    return build_model(config, state, QuantConfig(quant, symmetric=symmetric), dtype, device, max_seq_len,
                       progress=False, options=options)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from woq.models.fetch import fetch_default_model

    return fetch_default_model()


@pytest.fixture(scope="session")
def smollm2_int4(smollm2_dir):
    from woq.models.loader import load_model
    from woq.models.quant_config import QuantConfig

    return load_model(str(smollm2_dir), QuantConfig("int4"), device="cpu", max_seq_len=1024, progress=False)


class PrefillCounter:
    """An engine observer that adds up the prompt tokens prefilled and keeps each step's
    (decode batch, prompt tokens) (and ignores the rest)."""

    def __init__(self):
        self.prefill_tokens = 0
        self.steps: list[tuple[int, int]] = []

    def on_step(self, batch_size, prefill_tokens):
        self.prefill_tokens += prefill_tokens
        self.steps.append((batch_size, prefill_tokens))

    def on_iteration(self, kind, seconds):
        pass

    def on_preempt(self):
        pass

    def on_first_token(self, seconds):
        pass

    def on_token_latency(self, seconds):
        pass

    def on_finish(self, *args):
        pass


def run_to_end(engine, requests: list, timeout: float = 300, arrivals: tuple = ()) -> list[list]:
    """Queue every (prompt ids, SamplingParams) of ``requests`` on ``engine`` (not started:
    all of them arrive before its first step), start it, wait for them all and shut it
    down; each request's ids, then its finish reason. ``arrivals``: (request index, tokens,
    prompt ids, SamplingParams), each submitted from that request's sink once it has that
    many tokens (on the engine thread: at the same point of its stream whatever the
    schedule); their results follow those of ``requests``."""
    import threading

    out: list[list] = [[] for _ in range(len(requests) + len(arrivals))]
    done = threading.Semaphore(0)

    def sink_for(i):
        def sink(ev):
            had = len(out[i])
            out[i].extend(ev.token_ids)
            for k, (j, n, prompt, params) in enumerate(arrivals):
                if j == i and had < n <= len(out[i]):
                    engine.submit(prompt, params, sink_for(len(requests) + k))
            if ev.finish_reason:
                out[i].append(ev.finish_reason)
                done.release()
        return sink

    for i, (prompt, params) in enumerate(requests):
        engine.submit(prompt, params, sink_for(i))
    engine.start()
    try:
        for _ in out:
            assert done.acquire(timeout=timeout)
    finally:
        engine.shutdown()
    return out


def metric_value(text: str, name: str, **labels) -> float:
    """The value of the series ``name{labels}`` in a Prometheus text exposition (0 if absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """``woq serve`` in a subprocess on loopback: the real CLI, uvicorn and model."""

    def __init__(self, *args: str, env: dict | None = None, python: str = sys.executable, cwd: Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # (its output, for failures' messages: removed when the server stops)
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"woq-server-{self.port}-", suffix=".log", delete=False)
        cmd = [python, "-m", "woq", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=cwd,
                                     env={**os.environ, **(env or {})})
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.output()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError("server did not become healthy")

    def output(self) -> str:
        # (through a file of its own: the server's processes write through this file's
        # shared offset, so seeking it would move where their next lines land)
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def smollm2_server(smollm2_dir):
    """``woq serve`` of SmolLM2 int4 for one test module, served as "smollm2" (16 sequences,
    1024-token context)."""
    s = LiveServer("--model", str(smollm2_dir), "--served-model-name", "smollm2", "--quant", "int4",
                   "--max-seq-len", "1024", "--max-num-seqs", "16")
    yield s
    s.stop()


def pytest_terminal_summary(terminalreporter):
    """Skips counted by reason (hundreds of GPU tests skip on a CPU machine), and the optional
    tools whose absence skipped tests named at the very end."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    reasons: dict[str, int] = {}
    for report in skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    terminalreporter.section("skipped, by reason")
    for reason, n in sorted(reasons.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{n:5d}  {reason}")
    missing = [reason for reason in reasons if reason.startswith("needs ") and "GPU" not in reason]
    for reason in missing:
        terminalreporter.write_line(f"optional tool missing: {reason.removeprefix('needs ')}", yellow=True, bold=True)
