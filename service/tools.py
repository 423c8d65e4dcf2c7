"""Tool calling: the formats models write their calls in, read from the chat template.

* **hermes** (Hermes, Qwen, and the fallback for templates that know no tools): each call
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
* **llama3_json** (Llama 3.x): ``{"name": ..., "parameters": {...}}``, several joined by
  ``;``, maybe after ``<|python_tag|>``;
* **mistral**: ``[TOOL_CALLS]`` then a JSON array of ``{"name": ..., "arguments": {...}}``.

A format gives (1) the grammar that makes the model write a call (``tool_choice``
``required`` or a named function: constrained decoding, ``engine/grammar.py``; the
function's ``parameters`` schema becomes the arguments' JSON schema), (2) the parser of a
finished text into content and calls, and (3) for streaming, the marker whose appearance
at the start of the output holds the text back until it can be parsed.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

# The system prompt a template without tool support gets (Hermes's convention).
FALLBACK_SYSTEM = (
    "You can call functions to answer the user. The functions are listed as JSON within <tools></tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with a JSON object holding its name and arguments within <tool_call></tool_call> "
    "tags, one per call:\n<tool_call>\n{{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}}\n"
    "</tool_call>")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it

    def openai(self, index: int | None = None) -> dict:
        out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _lark_literal(text: str) -> str:
    return json.dumps(text)


@dataclass(frozen=True)
class ToolFormat:
    name: str
    marker: str  # what a call begins with
    args_key: str  # "arguments" or "parameters"

    def call_schema(self, functions: list[dict]) -> dict:
        """The JSON schema of one call to any of ``functions`` (OpenAI function objects)."""
        def one(f: dict) -> dict:
            return {"type": "object", "properties": {"name": {"const": f["name"]},
                                                     self.args_key: f.get("parameters") or {"type": "object"}},
                    "required": ["name", self.args_key], "additionalProperties": False}

        return one(functions[0]) if len(functions) == 1 else {"anyOf": [one(f) for f in functions]}

    def grammar(self, functions: list[dict], parallel: bool, marker_token: int | None) -> str:
        """A Lark grammar (llguidance's, with ``%json`` schemas) of the output that is one call
        (``parallel``: one or more) to one of ``functions``. ``marker_token``: the marker's id
        where it is one special token (then matched as that token)."""
        call = json.dumps(self.call_schema(functions))
        mark = f"<[{marker_token}]>" if marker_token is not None else _lark_literal(self.marker)
        if self.name == "hermes":
            block = f'{mark} "\\n" call "\\n</tool_call>"'
            start = f'start: {block}' + (f' ("\\n" {block})*' if parallel else "")
        elif self.name == "llama3_json":
            start = 'start: call' + (' (";" " "? call)*' if parallel else "")
        else:  # mistral: the marker, then an array of calls
            start = f'start: {mark} " "? "[" call' + (' ("," " "? call)*' if parallel else "") + ' "]"'
        return f"{start}\ncall: %json {call}\n"

    def starts_call(self, text: str) -> bool | None:
        """Whether an output beginning with ``text`` is a call: True, False, or None while
        ``text`` is still a prefix of the marker (undecided)."""
        head = text.lstrip()
        if self.name == "llama3_json":
            head = head.removeprefix("<|python_tag|>")
            if not head:
                return None
            return head.startswith("{")
        if len(head) < len(self.marker):
            return None if self.marker.startswith(head) else False
        return head.startswith(self.marker)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output. All or nothing: an output with any call
        that does not parse (cut off by ``max_tokens``, or malformed) is returned whole as
        content with no calls, as vLLM's parsers do, so that no text is lost."""
        if self.name == "hermes":
            found = list(re.finditer(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.DOTALL))
            calls = [_call(m.group(1), "arguments") for m in found]
            if not calls or any(c is None for c in calls):
                return text, []
            content = text[: found[0].start()].strip()
            return content or None, calls
        if not self.starts_call(text):
            return text, []
        body = text.lstrip().removeprefix("<|python_tag|>").strip()
        if self.name == "mistral":
            body = body.removeprefix(self.marker).strip()
            try:
                items, end = json.JSONDecoder().raw_decode(body)
            except ValueError:
                return text, []
            if not isinstance(items, list) or body[end:].strip():
                return text, []
            calls = [_call_obj(item, "arguments") for item in items]
        else:
            calls, decoder, i = [], json.JSONDecoder(), 0
            while i < len(body):
                try:
                    obj, i = decoder.raw_decode(body, i)
                except ValueError:
                    return text, []
                calls.append(_call_obj(obj, "parameters"))
                while i < len(body) and body[i] in " \n;":
                    i += 1
        return (text, []) if not calls or any(c is None for c in calls) else (None, calls)


def _call_obj(obj, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _call(text: str, args_key: str) -> ToolCall | None:
    try:
        return _call_obj(json.loads(text), args_key)
    except ValueError:
        return None


FORMATS = {
    "hermes": ToolFormat("hermes", "<tool_call>", "arguments"),
    "llama3_json": ToolFormat("llama3_json", "{", "parameters"),
    "mistral": ToolFormat("mistral", "[TOOL_CALLS]", "arguments"),
}


def detect(template: str | None) -> tuple[ToolFormat, bool]:
    """The format a chat template's model writes calls in, and whether the template itself
    renders ``tools`` (else the tools go into a system message, ``FALLBACK_SYSTEM``)."""
    t = template or ""
    knows_tools = "tools" in t
    if "[TOOL_CALLS]" in t:
        return FORMATS["mistral"], knows_tools
    if "<|python_tag|>" in t or "ipython" in t:
        return FORMATS["llama3_json"], knows_tools
    return FORMATS["hermes"], knows_tools


@dataclass(frozen=True)
class TemplateTools:
    """What a chat template says about tool calls: the format its model writes them in,
    whether the template renders ``tools`` itself, and the format's marker as one special
    token's id where the tokenizer has it as one (None: text)."""

    fmt: ToolFormat
    knows_tools: bool
    marker_token: int | None


def template_tools(tokenizer) -> TemplateTools:
    """``TemplateTools`` of a tokenizer's chat template (read once per server)."""
    fmt, knows_tools = detect(getattr(tokenizer, "chat_template", None))
    return TemplateTools(fmt, knows_tools, tokenizer.get_added_vocab().get(fmt.marker))


def fallback_call(name: str, arguments) -> str:
    """An earlier call written back for a template that knows no tools, in the format its
    system message (``FALLBACK_SYSTEM``) asks the model to use."""
    return "\n<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class ToolStream:
    """A streamed output that may be a call: text passes through until the output is known
    not to start with the format's marker; an output that does is held back whole, and
    parsed at the end."""

    def __init__(self, fmt: ToolFormat):
        self.fmt, self.held, self.decided = fmt, "", None

    def feed(self, text: str) -> str:
        """The text to stream now."""
        if self.decided is False:
            return text
        self.held += text
        if self.decided is None:
            self.decided = self.fmt.starts_call(self.held)
            if self.decided is False:
                out, self.held = self.held, ""
                return out
        return ""

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(text still to stream, the calls) at the end of the output."""
        if not self.held:
            return "", []
        content, calls = self.fmt.parse(self.held)
        return (content or "", calls) if calls else (self.held, [])
