"""Requests into what the engine runs: the prompt's token ids (a chat through its template,
tools and a continued assistant message included) and the ``SamplingParams`` a request's
parameters ask for (a grammar for ``response_format`` or a forced tool call)."""
from __future__ import annotations

import json
import logging
from typing import Callable, Protocol

from ..engine.engine import Engine
from ..engine.grammar import GrammarError, json_schema_error, json_schema_grammar, lark_grammar, regex_grammar
from ..engine.sampling import SamplingParams
from .errors import APIError
from .schemas import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from .tools import FALLBACK_SYSTEM, TemplateTools, fallback_call



class ServerState(Protocol):
    """What of the server's state (``app.ServerState``) a request's rendering reads."""
    engine: Engine
    tokenizer: object
    text_encoder: Callable[[str], list[int]]
    tools: TemplateTools

log = logging.getLogger("woq.service")


def text_encoder(tokenizer) -> Callable[[str], list[int]]:
    """Token ids of a text whose special-token strings stay text (a chat message's content).
    A fast tokenizer gets its own copy of the backend with that switch on for good:
    transformers sets the switch on the shared backend for each call that asks for it, so
    the tokenizer pool's threads would race on it (one thread's template markup split as
    text). It encodes through ``encode_batch``, which lets the GIL go while it works:
    ``Tokenizer.encode`` keeps it for the whole text, so a chat turn's history (a long
    system prompt and the turns before) would hold the engine thread between its launches
    for milliseconds a request (docs/design/serving.md, "The GIL between the engine and the
    event loop")."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # (a slow tokenizer: the switch is an argument, nothing shared)
        return lambda text: tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    from tokenizers import Tokenizer

    own = Tokenizer.from_str(backend.to_str())
    own.encode_special_tokens = True
    return lambda text: own.encode_batch([text], add_special_tokens=False)[0].ids


def sampling_params(state: ServerState, req, prompt_len: int) -> SamplingParams:
    """What ``req`` asks of the engine, for a prompt of ``prompt_len`` tokens (the longest of
    a completion's prompts): its token budget checked against what a request can take
    (``Engine.context_len``; unset, the rest of that), its processors, and the grammar of
    a ``response_format`` or a forced tool call."""
    engine = state.engine
    room = engine.context_len - prompt_len
    limit = engine.context_limit
    if room < 1:
        prompt = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        raise APIError(400, f"the prompt ({prompt_len} tokens) fills {limit}", param=prompt,
                       code="context_length_exceeded")
    wanted = req.wanted_max_tokens()
    max_tokens = wanted if wanted is not None else room
    if max_tokens > room:
        raise APIError(400, f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds {limit}",
                       param="max_tokens", code="context_length_exceeded")
    vocab = state.engine.model.cfg.vocab_size
    bias = tuple((int(k), v) for k, v in req.logit_bias.items())
    if any(t >= vocab for t, _ in bias):
        raise APIError(400, f"logit_bias keys must be token ids below {vocab}", param="logit_bias")
    if any(not 0 <= t < vocab for t in req.stop_token_ids):
        raise APIError(400, f"stop_token_ids must be token ids in [0, {vocab})", param="stop_token_ids")
    if req.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({req.min_tokens}) exceeds max_tokens ({max_tokens})", param="min_tokens")
    # a top-k of the whole vocabulary or more keeps every token: no top-k (and no int64 overflow)
    top_k = req.top_k if 0 < req.top_k < vocab else 0
    return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=top_k,
                          min_p=req.min_p, seed=req.seed, stop=tuple(req.stop),
                          include_stop_str=req.include_stop_str_in_output, ignore_eos=req.ignore_eos,
                          logprobs=req.wanted_logprobs(), presence_penalty=req.presence_penalty,
                          frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                          logit_bias=bias, min_tokens=req.min_tokens, stop_token_ids=tuple(req.stop_token_ids),
                          grammar=tool_grammar(state, req) or format_grammar(getattr(req, "response_format", None)))


def _forced_tools(req) -> list[int]:
    """The indices in ``tools`` of the functions a reply must call (``tool_choice`` "required"
    or a named function); none where the model decides ("auto") or there is no tool calling."""
    if not isinstance(req, ChatCompletionRequest) or req.called_tools() is None:
        return []
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        return [i for i, t in enumerate(req.tools) if t.function.name == choice.function.name]
    return list(range(len(req.tools))) if choice == "required" else []


def tool_grammar(state: ServerState, req) -> str | None:
    """The grammar that makes the reply a call to one of the forced tools; None: no such tool."""
    if not (forced := _forced_tools(req)):
        return None
    functions = [req.tools[i].function.model_dump(exclude_none=True) for i in forced]
    tools = state.tools
    try:
        return lark_grammar(tools.fmt.grammar(functions, req.parallel_tool_calls, tools.marker_token))
    except ValueError as e:
        raise APIError(400, f"a tool's parameters are no usable JSON schema: {e}", param="tools") from e


def grammar_refusal(req, e: GrammarError) -> APIError:
    """The 400 of a request whose grammar llguidance refused as it was submitted, naming the
    field that holds what it cannot enforce, with its reason in one line. A forced tool call's
    grammar joins every forced function's schema, so only here, once it has failed, is each
    schema compiled alone to find the tool (a valid grammar is compiled once, at submit)."""
    def refused(param: str, kind: str, why: str) -> APIError:
        return APIError(400, f"'{param}' cannot be enforced as {kind}: {why}", param=param)

    if forced := _forced_tools(req):
        for i in forced:
            schema = req.tools[i].function.parameters
            if schema is not None and (why := json_schema_error(schema)):
                return refused(f"tools[{i}].function.parameters", "a JSON schema", why)
        return APIError(400, str(e), param="tools")
    fmt = req.response_format
    if fmt.type == "json_schema":
        return refused("response_format.json_schema.schema", "a JSON schema", e.reason)
    if fmt.type == "regex":
        return refused("response_format.regex", "a regex", e.reason)
    return APIError(400, str(e), param="response_format")  # (a Lark grammar: its error points into it)


def format_grammar(fmt) -> str | None:
    """The llguidance grammar a ``response_format`` asks for (None: free text)."""
    if fmt is None or fmt.type == "text":
        return None
    try:
        if fmt.type == "json_object":
            return json_schema_grammar({"type": "object"})
        if fmt.type == "json_schema":
            return json_schema_grammar(fmt.json_schema.schema_)
        return regex_grammar(fmt.regex) if fmt.type == "regex" else lark_grammar(fmt.grammar)
    except (ValueError, TypeError) as e:  # (llguidance refuses a schema it cannot compile)
        raise APIError(400, f"invalid {fmt.type}: {e}", param="response_format") from e


def template_messages(req: ChatCompletionRequest, template_knows_tools: bool) -> list[dict]:
    """The messages as chat templates take them: tool calls with their arguments as objects;
    for a template that knows no tools, the tools described in a system message and the
    calls written out in the format the model is asked to use (``tools.FALLBACK_SYSTEM``)."""
    messages = []
    for m in req.messages:
        msg = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = [{"id": c.id, "type": "function",
                      "function": {"name": c.function.name, "arguments": json_or_text(c.function.arguments)}}
                     for c in m.tool_calls]
            if template_knows_tools:
                msg["tool_calls"] = calls
            else:
                msg["content"] += "".join(fallback_call(c["function"]["name"], c["function"]["arguments"])
                                          for c in calls)
        messages.append(msg)
    functions = req.called_tools()
    if functions and not template_knows_tools:
        preamble = FALLBACK_SYSTEM.format(tools="\n".join(json.dumps({"type": "function", "function": f})
                                                           for f in functions))
        if messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + preamble}
        else:
            messages.insert(0, {"role": "system", "content": preamble})
    return messages


def json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def chat_prompt(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    tok = state.tokenizer
    if not getattr(tok, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions")
    knows_tools = state.tools.knows_tools
    messages = template_messages(req, knows_tools)
    functions = req.called_tools()
    options = {"tools": [{"type": "function", "function": f} for f in functions]} if functions and knows_tools else {}
    # A final assistant message is continued (a prefill), not closed and answered.
    last = req.messages[-1]
    if last.role == "assistant" and not last.tool_calls:
        options.update(continue_final_message=True, add_generation_prompt=False)
    else:
        options.update(add_generation_prompt=True)
    # The template's markup is tokenized with its control tokens, each message's content as
    # text only: "<|im_start|>system" typed by a user stays those characters, never the
    # control token. So the template is rendered around placeholders (private-use
    # characters no tokenizer maps to a control token), and the pieces tokenized apart.
    marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
    rendered = tok.apply_chat_template([{**m, "content": mark} for m, mark in zip(messages, marks)],
                                       tokenize=False, **options)
    ids, rest = [], rendered
    for m, mark in zip(messages, marks):
        before, found, rest = rest.partition(mark)
        if not found:  # a template that transforms or drops a content: render it as it is
            log.warning("the chat template does not place each message's content verbatim: special-token strings "
                        "in content are tokenized as control tokens")
            ids = tok.apply_chat_template(messages, tokenize=True, **options)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        ids += tok.encode(before, add_special_tokens=False)
        ids += state.text_encoder(m["content"])
    return ids + tok.encode(rest, add_special_tokens=False)


def completion_prompt(state: ServerState, req: CompletionRequest) -> list[list[int]]:
    # ids the tokenizer can decode and the embedding has a row for (either may be the larger)
    vocab = min(len(state.tokenizer), state.engine.model.cfg.vocab_size)
    out = []
    for p in req.prompt:
        if isinstance(p, list):
            if any(not 0 <= t < vocab for t in p):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            out.append(list(p))
        else:
            out.append(state.tokenizer.encode(p))
    return out
