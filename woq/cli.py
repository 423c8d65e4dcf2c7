"""The ``woq`` command: ``woq serve``, ``woq generate PROMPT``, ``woq quantize MODEL OUT``,
``woq eval ppl MODEL``.

Flags and ``WOQ_*`` environment variables come from the pydantic-settings models in
``service/config.py`` (``woq serve --help`` lists them).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, CliApp, CliPositionalArg, CliSubCommand, SettingsConfigDict

from woq.service.config import GenerateSettings, ModelSettings, ServeSettings


class Serve(ServeSettings):
    """Serve the model over OpenAI-compatible HTTP (chat, completions, streaming, metrics)."""

    def cli_cmd(self) -> None:
        from woq.service.server import serve

        serve(self)


class Generate(GenerateSettings):
    """Generate a completion for one prompt and print it."""

    prompt: CliPositionalArg[str]

    def cli_cmd(self) -> None:
        from woq.engine.engine import Engine
        from woq.engine.sampling import SamplingParams
        from woq.service.server import eos_token_ids, load

        loaded = load(self)
        tok = loaded.tokenizer
        if self.chat and getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template([{"role": "user", "content": self.prompt}], add_generation_prompt=True,
                                          tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        else:
            ids = tok.encode(self.prompt)
        engine = Engine(loaded.model, tok, eos_token_ids(loaded), max_num_seqs=1, max_seq_len=self.max_seq_len)
        engine.start()
        try:
            params = SamplingParams(max_tokens=min(self.max_tokens, engine.max_seq_len - len(ids)),
                                    temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed)
            out = engine.generate(ids, params)
        finally:
            engine.shutdown()
        print(out.text)
        print(f"[{out.completion_tokens} tokens, finish_reason={out.finish_reason}]", file=sys.stderr)


class Quantize(BaseSettings):
    """Quantize a model once and write a woq checkpoint (loads in seconds, no re-quantizing)."""

    model_config = SettingsConfigDict(env_prefix="WOQ_", cli_kebab_case=True, cli_implicit_flags=True,
                                      protected_namespaces=(), extra="ignore")

    model: CliPositionalArg[str] = Field(description="model alias, Hugging Face directory or .gguf file")
    out: CliPositionalArg[Path] = Field(description="output directory")
    method: Literal["rtn", "gptq"] = Field("gptq", description="round-to-nearest or GPTQ (calibrated)")
    bits: int = Field(4, description="4 or 8")
    group_size: int = Field(128, description="0 = per-channel")
    sym: bool = Field(False, description="symmetric (no zero points)")
    act_order: bool = Field(True, description="GPTQ: quantize columns by decreasing Hessian diagonal "
                                              "(static groups: no cost at run time)")
    quantize_lm_head: bool = False
    calib: Path | None = Field(None, description="calibration text (default: wikitext-2 valid.txt)")
    samples: int = Field(128, description="GPTQ calibration windows")
    seq_len: int = Field(512, description="tokens per calibration window")
    device: str = Field("auto", description="auto, cpu, cuda")
    dtype: Literal["float16", "bfloat16", "float32"] = Field(
        "float16", description="dtype the unquantized tensors (embeddings, norms, biases) are stored in: the "
        "activations'")

    def cli_cmd(self) -> None:
        import time

        import torch

        from woq.kernels.options import default_cache_dir
        from woq.models.checkpoint import save_checkpoint
        from woq.models.loader import read_checkpoint, resolve_device, resolve_source
        from woq.models.quant_config import QuantConfig
        from woq.models.quantize import quantize_model

        t0 = time.perf_counter()
        directory, gguf = resolve_source(self.model)
        config, tokenizer, state, quantized = read_checkpoint(directory, gguf, default_cache_dir())
        if quantized:
            raise SystemExit(f"{self.model} is already quantized")
        if self.bits not in (4, 8):
            raise SystemExit(f"--bits must be 4 or 8, got {self.bits}")
        quant = QuantConfig(f"int{self.bits}", self.group_size, self.sym, self.quantize_lm_head)
        model = quantize_model(config, state, tokenizer, quant, self.method, self.act_order, self.calib, self.samples,
                               self.seq_len, resolve_device(self.device))
        info = {"method": self.method, "bits": self.bits, "group_size": self.group_size or "channel",
                "symmetric": self.sym}
        if self.method == "gptq":  # (what calibrated it)
            info.update(act_order=self.act_order, samples=self.samples, seq_len=self.seq_len,
                        calibration=str(self.calib or "wikitext-2 valid.txt"))
        save_checkpoint(model, config, tokenizer, self.out, str(self.model), info, getattr(torch, self.dtype))
        print(f"wrote {self.out} ({quant.describe()}, {self.method}) in {time.perf_counter() - t0:.0f} s")


class EvalPpl(ModelSettings):
    """Perplexity on a text (wikitext-2 test.txt by default): the first 40 windows of 512 tokens,
    --windows N of them, or --full."""

    model: CliPositionalArg[str] = Field(description="model alias, Hugging Face directory, .gguf or woq checkpoint")
    text: Path | None = Field(None, description="text file (default: wikitext-2 test.txt)")
    windows: int = Field(40, ge=1, description="score the text's first N windows")
    full: bool = Field(False, description="score every window of the text (overrides --windows)")
    seq_len_eval: int = Field(512, description="tokens per window")

    def cli_cmd(self) -> None:
        import json

        from woq.models.evaluate import DEFAULT_TEXT, perplexity
        from woq.service.server import load

        loaded = load(self)
        text = Path(self.text or DEFAULT_TEXT).read_text()
        r = perplexity(loaded.model, loaded.tokenizer, text, self.seq_len_eval, None if self.full else self.windows)
        print(json.dumps({"model": loaded.name, "quant": loaded.quantization, "device": str(loaded.model.device),
                          "perplexity": round(r.perplexity, 4), "tokens": r.tokens, "windows": r.windows}))


class Eval(BaseSettings):
    """Evaluate a model."""

    ppl: CliSubCommand[EvalPpl] = Field(description="perplexity on a text (wikitext-2 test.txt by default)")

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


class Woq(BaseSettings):
    """woq: weight-only int8/int4 LLM inference server."""

    model_config = SettingsConfigDict(cli_prog_name="woq", cli_kebab_case=True, cli_implicit_flags=True,
                                      cli_hide_none_type=True)

    serve: CliSubCommand[Serve] = Field(description="serve a model over OpenAI-compatible HTTP")
    generate: CliSubCommand[Generate] = Field(description="generate a completion for one prompt and print it")
    quantize: CliSubCommand[Quantize] = Field(description="quantize a model once into a woq checkpoint")
    eval: CliSubCommand[Eval] = Field(description="evaluate a model (perplexity)")

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


def _flag_errors(exc) -> str:
    """A pydantic ValidationError as one line naming the flags: "--port: Input should be ..."."""
    parts = []
    for e in exc.errors():
        loc = [str(x) for x in e["loc"] if not str(x).isdigit()]
        flag = "--" + loc[-1].replace("_", "-") if loc else "input"
        given = f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else ""
        parts.append(f"{flag}: {e['msg'].removeprefix('Value error, ')}{given}")
    return "; ".join(parts)


def _is_user_error(exc: Exception) -> bool:
    """Whether ``exc`` is a user's mistake (a bad flag, path, model file or device), shown as
    one line. Anything else is a bug and keeps its traceback. A bad flag is told apart
    before the modules of the other mistakes are imported: they import torch, seconds a
    flag's error need not wait for (by the time one of theirs is raised, they are in)."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    if isinstance(exc, (ValidationError, SettingsError)):
        return True
    from woq.models.importers import CheckpointError
    from woq.models.loader import DeviceError, ModelSourceError
    from woq.models.sharding import ShardError
    from woq.service.server import PortInUseError

    return isinstance(exc, (CheckpointError, DeviceError, ModelSourceError, PortInUseError, ShardError))


def app(argv: list[str] | None = None) -> None:
    """The ``woq`` command. A user's mistake ends in one line on stderr and exit status 2;
    ``--debug`` (or ``WOQ_LOG_LEVEL=debug``) shows its traceback instead."""
    import os

    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("WOQ_LOG_LEVEL", "").lower() == "debug"
    argv = [a for a in argv if a != "--debug"]
    try:
        CliApp.run(Woq, cli_args=argv)
    except Exception as exc:  # (not SystemExit: --help imports nothing more)
        if debug or not _is_user_error(exc):
            raise
        from pydantic import ValidationError

        message = _flag_errors(exc) if isinstance(exc, ValidationError) else str(exc).strip().splitlines()[0]
        print(f"woq: error: {message}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    app()
