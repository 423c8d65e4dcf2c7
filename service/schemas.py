"""OpenAI-compatible request and response bodies (the subset we serve).

Validation lives here so that every bad field becomes a 400 with the OpenAI error JSON
naming the field (``service/errors.py``), never a stack trace. Every OpenAI parameter either
works or is refused by name: a client must never get a 200 for a request whose parameter
had no effect (a few informational ones aside: ``_IGNORED``). So the bodies

* forbid fields that are no OpenAI parameter nor one of our extensions (``top_k``, ``ignore_eos``);
* take an OpenAI parameter we do not implement, or one of vLLM's extensions that its clients
  send, only at the value that asks for nothing (its default: real clients send
  ``presence_penalty: 0`` or ``skip_special_tokens: true``), refusing any other value
  (``unsupported``);
* read ``null`` as "the default", as OpenAI's API does;
* are strict: ``"5"`` or ``true`` is no integer (an integer is a number, though).
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator, field_validator, model_validator
from pydantic_core import PydanticCustomError


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality: 0 and 0.0 alike, but ``false`` is not 0."""
    numbers = (int, float)
    if type(value) in numbers and type(neutral) in numbers:
        return value == neutral
    return type(value) is type(neutral) and value == neutral


def _refused(param: str | None, neutral: tuple = ()) -> PydanticCustomError:
    """The error of a parameter we do not implement. ``param`` names it where a model's
    validator raises it (whose location is the model's), None in the field's own validator."""
    send = " or ".join(json.dumps(n) for n in neutral)
    message = "is not supported by this server; leave it out" + (", or send {send}" if neutral else "")
    return PydanticCustomError("unsupported_parameter", message, {"param": param, "send": send})


class _Body(BaseModel):
    """A request body or a part of one."""
    model_config = ConfigDict(strict=True, extra="forbid", protected_namespaces=())

    # OpenAI parameters (and vLLM's extensions) this server does not implement, with the values
    # that ask for nothing (beyond null, always accepted): such a value is accepted, any other
    # refused.
    unsupported: ClassVar[dict[str, tuple]] = {}

    @model_validator(mode="before")
    @classmethod
    def _neutral_or_refused(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # (the model's own check refuses it: "must be an object")
        data = {k: v for k, v in data.items() if v is not None}  # null asks for nothing, whatever the field
        for name, neutral in cls.unsupported.items():
            if name in data:
                value = data.pop(name)
                if not any(_same(value, n) for n in neutral):
                    raise _refused(name, neutral)
        return data


# Accepted and ignored: an identifier for OpenAI's abuse monitoring, tags and storage of the
# completion on OpenAI's side, billing tier, prompt cache routing. None changes what the model
# generates, and clients (and SDK wrappers) send them routinely.
_IGNORED = "accepted and ignored"


class StreamOptions(_Body):
    unsupported = {"include_obfuscation": (False,), "continuous_usage_stats": (False,)}

    include_usage: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = Field(None, description=_IGNORED)

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") in ("image_url", "input_audio", "file", "refusal"):
            raise PydanticCustomError("unsupported_value", "cannot be '{value}': this server reads text parts only",
                                      {"param": "type", "value": data["type"]})
        return data


def _content_parts(v: Any) -> Any:
    """A message's content as its text parts: a string is one."""
    if isinstance(v, str):
        return [{"type": "text", "text": v}]
    if not isinstance(v, list):
        raise PydanticCustomError("content_type", 'must be a string or an array of text parts ({"type": "text", '
                                                  '"text": "..."})')
    return v


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text


class ToolCallIn(_Body):
    """A call an earlier assistant turn made (sent back with the conversation)."""
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    unsupported = {"name": ("",), "function_call": (), "refusal": (), "audio": ()}

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Annotated[list[TextPart], BeforeValidator(_content_parts, json_schema_input_type=str | list[TextPart])] = []
    tool_calls: list[ToolCallIn] = []  # (assistant)
    tool_call_id: str | None = None  # (tool: the call this message answers)

    @model_validator(mode="before")
    @classmethod
    def _no_functions(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("role") == "function":
            raise PydanticCustomError("unsupported_value", "cannot be 'function' on this server (deprecated): send "
                                      "'tool' messages",
                                      {"param": "role"})
        return data

    @model_validator(mode="after")
    def _roles(self):
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError("tool_calls_role", "is only for assistant messages, not '{role}' ones",
                                      {"param": "tool_calls", "role": self.role})
        # (param: the missing field, so that the error names it: "'messages[1].tool_call_id' is required")
        if self.role == "tool" and not self.tool_call_id:
            raise PydanticCustomError("missing", "a tool message needs 'tool_call_id'", {"param": "tool_call_id"})
        if not self.content and not self.tool_calls:
            hint = {"hint": "or 'tool_calls'"} if self.role == "assistant" else {}
            raise PydanticCustomError("missing", "a message needs 'content' (or, from the assistant, 'tool_calls')",
                                      {"param": "content", **hint})
        return self

    def text(self) -> str:
        return "".join(p.text for p in self.content)


class FunctionSpec(_Body):
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


_StopString = Annotated[str, Field(min_length=1)]


def _stops(v: Any) -> Any:
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list):
        raise PydanticCustomError("stop_type", "must be a string or an array of up to 4 strings")
    return v


def _logit_bias(v: dict[str, float]) -> dict[str, float]:
    for key, bias in v.items():
        if not (key.isascii() and key.isdigit()):  # (str.isdigit takes "²", which int() does not)
            raise PydanticCustomError("logit_bias_key", "keys must be token ids (as strings), not '{key}'",
                                      {"key": key})
        if not -100 <= bias <= 100:
            raise PydanticCustomError("logit_bias_value", "values must be in [-100, 100]")
    return v


class _Request(_Body):
    # vLLM's extensions at what this server does anyway: it skips special tokens in the text,
    # samples (no beam search) and serves first come, first served
    unsupported = {"skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
                   "use_beam_search": (False,), "length_penalty": (1.0,), "priority": (0,),
                   "truncate_prompt_tokens": ()}

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description="extension: 0 or -1 (vLLM's and SGLang's spelling) disables top-k")
    min_p: float = Field(0.0, ge=0, le=1, description="extension (vLLM's, SGLang's, llama.cpp's): keep the tokens "
                                                      "at least this times as likely as the most likely; 0 = off")
    seed: int | None = None
    stop: Annotated[list[_StopString], BeforeValidator(
        _stops, json_schema_input_type=_StopString | Annotated[list[_StopString], Field(max_length=4)])] = Field(
        [], max_length=4)
    n: int = Field(1, ge=1, le=16, description="choices of the same prompt (one prefill for all)")
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: Annotated[dict[str, float], AfterValidator(_logit_bias)] = Field(
        {}, description="token id (a string) -> a bias in [-100, 100] added to its logit")
    repetition_penalty: float = Field(1.0, gt=0, le=10, description="extension (vLLM's): CTRL's penalty, 1 = off")
    min_tokens: int = Field(0, ge=0, description="extension (vLLM's): no end of sequence before this many tokens")
    stop_token_ids: list[int] = Field([], max_length=64, description="extension (vLLM's): token ids that end "
                                                                       "the request")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="extension: generate max_tokens tokens, past the end of sequence")
    include_stop_str_in_output: bool = Field(False, description="extension (vLLM's): the stop string found ends "
                                                                  "the text rather than being cut from it")

    user: str | None = Field(None, description=_IGNORED)
    metadata: dict[str, str] | None = Field(None, description=_IGNORED)
    store: bool | None = Field(None, description=_IGNORED)
    service_tier: str | None = Field(None, description=_IGNORED)
    safety_identifier: str | None = Field(None, description=_IGNORED)
    prompt_cache_key: str | None = Field(None, description=_IGNORED)
    prompt_cache_retention: str | None = Field(None, description=_IGNORED)
    prompt_cache_options: dict[str, Any] | None = Field(None, description=_IGNORED)

    @field_validator("seed")
    @classmethod
    def _seed(cls, v):
        if v is not None and not (-(1 << 63) <= v < (1 << 63)):
            raise PydanticCustomError("seed_range", "must fit in 64 bits (a signed integer)")
        return v


class JsonSchemaFormat(_Body):
    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(..., alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """``text``; ``json_object`` (any JSON object); ``json_schema`` (JSON text matching the
    schema, always enforced: strict or not); extensions: ``regex`` and ``grammar`` (Lark)."""
    type: Literal["text", "json_object", "json_schema", "regex", "grammar"]
    json_schema: JsonSchemaFormat | None = None
    regex: str | None = None
    grammar: str | None = None

    @model_validator(mode="after")
    def _argument(self):
        needed = {"json_schema": "json_schema", "regex": "regex", "grammar": "grammar"}.get(self.type)
        if needed and getattr(self, needed) is None:
            raise PydanticCustomError("missing", "type '{type}' needs '{field}'",
                                      {"type": self.type, "field": needed, "param": needed,
                                       "hint": f"by type '{self.type}'"})
        return self


class ChatCompletionRequest(_Request):
    unsupported = {**_Request.unsupported,
                   # the deprecated function calling (tools replace it)
                   "functions": ([],), "function_call": ("none", "auto"),
                   "modalities": (["text"],), "audio": (),
                   "prediction": (), "reasoning_effort": ("none",), "verbosity": (), "web_search_options": (),
                   "moderation": (),
                   "echo": (False,)}  # (vLLM's: the prompt's text in the reply)

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=20, description="with 'logprobs': true")
    response_format: ResponseFormat | None = None
    tools: list[Tool] = Field([], max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _top_logprobs(self):
        # (as vLLM and llama.cpp's server do: answering without the logprobs asked for would hide the mistake)
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("top_logprobs_without_logprobs", "needs 'logprobs': true",
                                      {"param": "top_logprobs"})
        return self

    @model_validator(mode="after")
    def _tool_choice(self):
        named = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
        if (named or self.tool_choice == "required") and not self.tools:
            raise PydanticCustomError("tool_choice_without_tools", "asks for a tool call but 'tools' is empty",
                                      {"param": "tool_choice"})
        if named and named not in {t.function.name for t in self.tools}:
            raise PydanticCustomError("tool_choice_unknown", "names '{name}', which is not among 'tools'",
                                      {"param": "tool_choice", "name": named})
        if self.tools and self.response_format is not None and self.response_format.type != "text" \
                and self.tool_choice not in (None, "none"):
            raise PydanticCustomError("tools_and_format", "cannot constrain the output to a tool call and to "
                                      "response_format at once", {"param": "response_format"})
        return self

    def wanted_logprobs(self) -> int | None:
        return self.top_logprobs if self.logprobs else None

    def called_tools(self) -> list[dict] | None:
        """The function objects a reply may call (None: no tool calling: no tools, or
        ``tool_choice`` "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.function.model_dump(exclude_none=True) for t in self.tools]

    def wanted_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


MAX_PROMPTS = 16


def _prompts(v: Any) -> list[str | list[int]]:
    """The request's prompts: a string or token ids, or an array of either (several prompts,
    each its own choices)."""
    many = isinstance(v, list) and bool(v) and all(isinstance(p, (str, list)) for p in v)
    prompts = v if many else [v]
    if len(prompts) > MAX_PROMPTS:
        raise PydanticCustomError("prompt_count", "holds {count} prompts; this server takes at most {limit} in one "
                                                  "request",
                                  {"count": len(prompts), "limit": MAX_PROMPTS})
    for p in prompts:
        if not (isinstance(p, str) or isinstance(p, list) and all(type(t) is int for t in p)):
            raise PydanticCustomError("prompt_type", "must be a string or an array of token ids (integers), or an "
                                                     "array of those")
        if not p:
            raise PydanticCustomError("prompt_empty", "must not be empty")
    return prompts


class CompletionRequest(_Request):
    unsupported = {**_Request.unsupported, "best_of": (1,), "suffix": ("",)}

    prompt: Annotated[list[str | list[int]], PlainValidator(
        _prompts, json_schema_input_type=str | list[str] | list[int] | list[list[int]])]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20, description="the sampled token's and this many most likely "
                                                                 "tokens' log-probabilities")

    def wanted_logprobs(self) -> int | None:
        return self.logprobs

    def wanted_max_tokens(self) -> int | None:
        return self.max_tokens


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error's body, OpenAI's."""
    error: ErrorDetail


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
    # (vLLM's extension, read by clients that size their prompts: the most tokens, prompt and
    # completion together, one request can take)
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
