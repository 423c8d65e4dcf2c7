"""Configuration: one pydantic-settings model per command, read from flags and ``WOQ_*``.

Every field is both a kebab-case flag (``--max-num-seqs 8``) and an environment
variable (``WOQ_MAX_NUM_SEQS=8``); flags win. ``docs``/README list them all.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, FilePath, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from ..kernels.options import DecodeStepOptions, RuntimeOptions
from ..models.fetch import DEFAULT_MODEL

if TYPE_CHECKING:  # (torch and the model code load only when a command runs: a fast --help)
    import torch

    from ..models.quant_config import QuantConfig



class ModelSettings(BaseSettings):
    """What model to load and how to quantize it."""

    model_config = SettingsConfigDict(env_prefix="WOQ_", extra="ignore", cli_kebab_case=True, cli_hide_none_type=True,
                                      cli_implicit_flags=True, protected_namespaces=())

    model: str = Field(DEFAULT_MODEL, description="model alias, Hugging Face directory or .gguf file")
    quant: Literal["int8", "int4", "none"] = Field("int8", description="weight quantization")
    group_size: int | None = Field(
        None, description="0 = per-channel; 32/64/128/256 = group-wise (unset: per-channel for int8, 128 for int4)"
    )
    sym: bool | None = Field(None, description="symmetric quantization (unset: yes for int8, no for int4: zero points)")
    quantize_lm_head: bool = Field(False, description="also quantize the LM head")
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = Field(
        "auto", description="activation dtype (auto: float16 on CUDA, float32 on CPU)"
    )
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    max_seq_len: int = Field(2048, ge=16, description="longest prompt + completion, in tokens")
    cache: Path = Field(Path.home() / ".cache" / "woq", description="fetched models, compiled kernels, tuning tables")
    decode_step: Literal["auto", "on", "off"] = Field(
        "auto", description="the persistent batch-1 decode step on CUDA (auto: for models 4096 wide or more)"
    )

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not (v in ("auto", "cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit())):
            raise ValueError(f"unknown device {v!r}: use auto, cpu, cuda or cuda:N")
        return v

    @field_validator("group_size")
    @classmethod
    def _group(cls, v: int | None) -> int | None:
        from ..models.quant_config import QuantConfig

        QuantConfig(group_size=v)  # raises a clear message for unsupported sizes
        return v

    def quant_config(self) -> QuantConfig:
        from ..models.quant_config import QuantConfig

        return QuantConfig(self.quant, self.group_size, self.sym, self.quantize_lm_head)

    def torch_dtype(self) -> torch.dtype | None:
        import torch

        return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}.get(self.dtype)

    def runtime_options(self) -> RuntimeOptions:
        """The options the model, the engine and the kernels run with."""
        enabled = {"auto": None, "on": True, "off": False}[self.decode_step]
        return RuntimeOptions(cache_dir=self.cache, decode_step=DecodeStepOptions(enabled=enabled))


class ServeSettings(ModelSettings):
    """Serve the model over OpenAI-compatible HTTP."""

    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(8000, ge=0, le=65535, description="port to bind")
    served_model_name: str | None = Field(None, description="model name clients send (default: from the model)")
    chat_template: FilePath | None = Field(None, description="a Jinja chat template file to use instead of the model's "
                                                         "(its tool-call format is read from it)")
    max_num_seqs: int | None = Field(None, ge=1, le=1024, description="sequences running at once (default: 256 "
                                     "on CUDA, 64 on CPU)")
    gpu_memory_fraction: float = Field(0.9, gt=0, le=1, description="share of GPU memory for weights + KV cache: the "
                                       "KV pool takes what is left after the weights and the measured peak of the "
                                       "largest step")
    kv_cache_gib: float = Field(1.0, gt=0, description="KV cache size on CPU (GiB)")
    block_size: Literal[8, 16, 32, 64] = Field(16, description="positions per KV cache block")
    prefix_caching: bool = Field(True, description="reuse the cached KV blocks of a prompt's prefix across requests")
    max_queue: int = Field(64, ge=0, description="requests waiting for KV blocks before new ones get 429")
    tensor_parallel_size: int = Field(1, ge=1, description="split the model over N processes (one GPU each on CUDA: "
                                      "NCCL; gloo on CPU); rank 0 serves HTTP. Started here, or by torchrun "
                                      "(RANK, WORLD_SIZE, MASTER_ADDR/PORT set)")
    peer_all_reduce: bool = Field(True, description="under tensor parallelism on GPUs that reach each other's "
                                  "memory, all-reduce small messages (decode steps) through peer buffers rather than "
                                  "NCCL")
    max_prefill_tokens: int | None = Field(None, ge=1, description="tokens of one step: the running sequences' decode "
                                           "tokens and prompt chunks (longer prompts go in chunks), which bounds a "
                                           "running stream's stall (default: the engine's, measured: "
                                           "docs/design/engine.md)")
    mixed_step_ratio: float | None = Field(None, ge=0, description="while streams decode, bound each step's prompt "
                                           "chunks so that the step takes at most this many of their decode steps, by "
                                           "step times measured at start-up, unless the requests need more prompt "
                                           "tokens a step to keep pace (0: the token budget alone; default: 2 on "
                                           "CUDA, 0 elsewhere)")
    kernel_timing_every: int = Field(8, ge=1, description="time one linear-layer call in N for the kernel metrics "
                                     "(under CUDA graphs: one replay in N runs the graph's timed twin)")
    cuda_graphs: bool = Field(True, description="replay decode steps through CUDA graphs (CUDA only)")
    prefill_graphs: bool = Field(True, description="with --cuda-graphs: replay packed prefill and mixed steps of up "
                                 "to 512 tokens through CUDA graphs too")
    api_key: str | None = Field(None, description="require 'Authorization: Bearer <key>' on /v1 routes")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="largest request body accepted (413 beyond)")
    request_timeout: float = Field(600.0, gt=0, description="seconds a request may take, queueing included (504)")
    header_timeout: float = Field(10.0, gt=0, description="seconds a client has to send a request's headers, from "
                                  "connecting or from the previous response (then 408, or just closed if it sent "
                                  "nothing; the connection closes)")
    body_timeout: float = Field(30.0, gt=0, description="seconds a request body may stall, no byte arriving while the "
                                "server waits for it (then 408; the connection closes)")
    drain_timeout: float = Field(30.0, ge=0, description="seconds SIGTERM waits for in-flight requests")
    log_format: Literal["auto", "json", "text"] = Field(
        "auto", description="log lines as JSON objects or plain text (auto: text on a terminal, else JSON)")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")


class GenerateSettings(ModelSettings):
    """Generate a completion for one prompt and print it."""

    max_tokens: int = Field(128, ge=1, description="tokens to generate")
    temperature: float = Field(0.0, ge=0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    chat: bool = Field(True, description="wrap the prompt in the model's chat template")
