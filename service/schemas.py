"""OpenAI-compatible request and response bodies (the subset we serve).

Validation lives here so that every bad field becomes a 400 with the OpenAI error JSON
naming the field (``service/errors.py``), never a stack trace.
"""
from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="extension: 0 disables top-k")
    seed: int | None = None
    stop: str | list[str] | None = Field(None, validate_default=True)
    n: int = Field(1, ge=1, le=1, description="only one choice per request is supported")
    stream: bool = False
    stream_options: "StreamOptions | None" = None
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops

    @field_validator("seed")
    @classmethod
    def _seed(cls, v):
        if v is not None and not (-(1 << 63) <= v < (1 << 63)):
            raise ValueError("seed must fit in 64 bits")
        return v


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def wanted_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            v = v[0]
        if (isinstance(v, str) and not v) or (isinstance(v, list) and not v):
            raise ValueError("prompt must not be empty")
        return v

    def wanted_max_tokens(self) -> int | None:
        return self.max_tokens


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt: int, completion: int) -> "Usage":
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "woq"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
