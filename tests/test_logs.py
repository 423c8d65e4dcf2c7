"""Logs and progress as a terminal and a log collector each want them: text with bars on a
terminal; one JSON object per line, without ANSI escapes, and progress as start/end lines
elsewhere."""
import io
import json
import logging
import sys

from woq.models.progress import progress
from woq.service.logs import setup_logging


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def _log_through(tty: bool, monkeypatch) -> str:
    stream = _Stream(tty)
    monkeypatch.setattr(sys, "stderr", stream)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging("info", "auto")
        # what uvicorn logs: the message, and a coloured copy of it for its own console
        logging.getLogger("uvicorn.error").info("Started server process [%d]", 42,
                                                extra={"color_message": "Started server process [\x1b[36m%d\x1b[0m]"})
        logging.getLogger("woq.test").info("\x1b[31mred\x1b[0m text")
        for _ in progress(range(3), "building layers"):
            pass
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    return stream.getvalue()


def test_json_lines_off_a_terminal_without_escapes(monkeypatch):
    lines = _log_through(False, monkeypatch).splitlines()
    records = [json.loads(line) for line in lines]  # every line one JSON object
    assert "\x1b" not in "".join(lines) and all("color_message" not in r for r in records)
    assert [r["msg"] for r in records] == ["Started server process [42]", "red text", "building layers: 3 steps",
                                           records[-1]["msg"]]
    assert records[-1]["msg"].startswith("building layers: 3 done in ")


def test_text_and_a_bar_on_a_terminal(monkeypatch):
    out = _log_through(True, monkeypatch)
    assert "INFO uvicorn.error: Started server process [42]" in out and not out.lstrip().startswith("{")
    assert "building layers: 100%" in out  # tqdm's bar
