"""Logs: plain text on a terminal, else (a file, a container's log collector) one JSON object
per line, with the request id of the request being served."""
from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import time

request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("woq_request_id", default=None)

# (color_message: uvicorn's copy of the message with ANSI colours, for its own console)
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "color_message"}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": _ANSI.sub("", record.getMessage()),
        }
        rid = request_id.get()
        if rid:
            out["request_id"] = rid
        out.update({k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str = "info", fmt: str = "auto") -> None:
    """``fmt``: "json", "text", or "auto" (text when stderr is a terminal)."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json" or (fmt == "auto" and not sys.stderr.isatty()):
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):  # uvicorn's own lines through the same formatter
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    logging.getLogger("uvicorn.access").disabled = True  # replaced by woq.access (with request ids)
