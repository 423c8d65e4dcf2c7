"""The ``woq`` command: ``woq serve``, ``woq generate PROMPT``.

Flags and ``WOQ_*`` environment variables come from the pydantic-settings models in
``service/config.py`` (``woq serve --help`` lists them).
"""
from __future__ import annotations

import sys

from pydantic_settings import BaseSettings, CliApp, CliPositionalArg, CliSubCommand, SettingsConfigDict

from woq.service.config import GenerateSettings, ServeSettings


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
        engine = Engine(loaded.model, tok, eos_token_ids(loaded), max_batch_size=1, max_seq_len=self.max_seq_len)
        engine.start()
        try:
            params = SamplingParams(max_tokens=min(self.max_tokens, engine.max_seq_len - len(ids)),
                                    temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed)
            out = engine.generate(ids, params)
        finally:
            engine.shutdown()
        print(out.text)
        print(f"[{out.completion_tokens} tokens, finish_reason={out.finish_reason}]", file=sys.stderr)


class Woq(BaseSettings):
    """woq: weight-only int8/int4 LLM inference server."""

    model_config = SettingsConfigDict(cli_prog_name="woq", cli_kebab_case=True)

    serve: CliSubCommand[Serve]
    generate: CliSubCommand[Generate]

    def cli_cmd(self) -> None:
        CliApp.run_subcommand(self)


def app() -> None:
    CliApp.run(Woq)


if __name__ == "__main__":
    app()
