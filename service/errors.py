"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can cause maps to a 4xx with a message naming the problem; any
other failure is a 500 whose body says only that (the details go to the log).
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("woq.service")


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status, headers=headers)


# What a pydantic error type says, in JSON's terms (the client wrote JSON, not Python)
_EXPECTED = {"string_type": "a string", "int_type": "an integer", "float_type": "a number",
             "bool_type": "true or false", "list_type": "an array", "dict_type": "an object",
             "model_type": "an object", "model_attributes_type": "an object"}
_BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"), "less_than_equal": ("<=", "le"),
           "less_than": ("<", "lt")}
# the ``code`` of the errors of parameters that are refused rather than malformed
_CODES = {"unsupported_parameter": "unsupported_parameter", "unsupported_value": "unsupported_value",
          "extra_forbidden": "unknown_parameter"}


def _json_type(value) -> str:
    for t, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"),
                    (list, "an array"), (dict, "an object")):
        if isinstance(value, t):
            return name
    return "null" if value is None else type(value).__name__


def _path(loc) -> str:
    """``("messages", 0, "content")`` as a client writes it: ``messages[0].content``."""
    out = ""
    for x in loc:
        out += f"[{x}]" if isinstance(x, int) else f".{x}" if out else str(x)
    return out


def _problem(e: dict) -> str:
    """What is wrong with the value at the error's location, to follow its name."""
    kind, ctx = e.get("type", ""), e.get("ctx") or {}
    if kind in _EXPECTED:
        return f"must be {_EXPECTED[kind]}, not {_json_type(e.get('input'))}"
    if kind in _BOUNDS:
        op, key = _BOUNDS[kind]
        return f"must be {op} {ctx[key]}"
    if kind == "literal_error":
        return f"must be {ctx['expected']}"
    if kind == "missing":
        return f"is required ({ctx['hint']})" if ctx.get("hint") else "is required"
    if kind == "extra_forbidden":
        return "is not a parameter of this API (neither OpenAI's nor an extension of this server)"
    if kind == "too_short":
        return f"must hold at least {ctx['min_length']} item(s)"
    if kind == "too_long":
        return f"must hold at most {ctx['max_length']} item(s)"
    if kind == "string_too_short" and ctx.get("min_length") == 1:
        return "must not be empty"
    return str(e.get("msg", "is invalid")).removeprefix("Value error, ")


def _is_json(request: Request) -> bool:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return ctype == "application/json" or ctype.endswith("+json")


def describe_validation(exc: RequestValidationError, request: Request) -> tuple[str, str | None, str | None]:
    """The message, param and code of a request's first validation error."""
    errs = exc.errors()
    if not errs:
        return "invalid request", None, None
    e = errs[0]
    if e.get("type") == "json_invalid":
        detail = (e.get("ctx") or {}).get("error", "cannot parse it")
        return f"the request body is not valid JSON: {detail} (at character {e['loc'][-1]})", None, None
    loc = [x for x in e.get("loc", ()) if x != "body"]
    param = (e.get("ctx") or {}).get("param")
    if param:  # (raised by a model's validator, whose location is the model's)
        loc.append(param)
    if not loc:  # the body as a whole
        if e.get("type") == "missing":
            return "the request body is empty; it must be a JSON object", None, None
        if not _is_json(request):
            # FastAPI parses only a body declared as JSON (so a browser's cross-site form post cannot pass)
            return "the request body must be JSON, sent with 'Content-Type: application/json'", None, None
        return f"the request body must be a JSON object, not {_json_type(e.get('input'))}", None, None
    param = _path(loc)
    return f"'{param}' {_problem(e)}", param, _CODES.get(e.get("type"))


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param, code = describe_validation(exc, request)
        return error_response(400, message, param=param, code=code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        bad = exc.__cause__
        if isinstance(bad, UnicodeDecodeError):  # (FastAPI's "There was an error parsing the body")
            return error_response(400, f"the request body is not valid UTF-8 (byte 0x{bad.object[bad.start]:02x} "
                                       f"at offset {bad.start}); send JSON as UTF-8 text", code="invalid_unicode")
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal server error", "server_error")
