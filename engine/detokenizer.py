"""Incremental detokenization with stop strings.

Token-by-token decoding of byte-level BPE can split a UTF-8 character across tokens, and
some tokenizers change the text of earlier tokens when later ones arrive (leading spaces).
We decode a short window of recent tokens twice (with and without the newest) and emit
the difference only when it is complete text. Text that could be the beginning of a stop
string is held back until it either completes the stop string (and is dropped, with
everything after it; or kept, with ``keep_stop``, as vLLM's ``include_stop_str_in_output``)
or is known not to.
"""
from __future__ import annotations

import re
from functools import cache


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), keep_stop: bool = False):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.keep_stop = keep_stop  # the stop string found stays at the text's end
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: tokens before it are settled text
        self.read_offset = 0  # tokens decoded into self.text so far
        self.text = ""  # all text produced so far (stop string removed)
        self.emitted = 0  # characters of self.text handed out
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """Append a token; return the text that can be released now ("" if none)."""
        if self.stopped:
            return ""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._apply_stop()
        return self._release()

    def finish(self) -> str:
        """Release whatever is held back (the request ends). Tokens that ended inside a UTF-8
        character are released as the tokenizer decodes them (U+FFFD), so the text is the
        decode of every token and no token is counted without its text."""
        if not self.stopped and self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            if len(full) > len(prefix):
                self.text += full[len(prefix) :]
                self.read_offset = len(self.ids)
                self._apply_stop()
        tail = self.text[self.emitted :]
        self.emitted = len(self.text)
        return tail

    def _apply_stop(self) -> None:
        if not self.stop:
            return
        longest = max(map(len, self.stop))
        start = max(0, self.emitted - longest)
        hits = [(i, -len(s)) for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
        if hits:
            at, minus_len = min(hits)  # the first to begin (of two there, the longer)
            self.text = self.text[: at - minus_len if self.keep_stop else at]
            self.stopped = True

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        if self.stopped:
            return 0
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _release(self) -> str:
        end = len(self.text) - self._held_back()
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted : end]
        self.emitted = end
        return out


@cache
def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): each byte is written as one printable character."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's piece for a raw byte


def token_bytes(tokenizer, token: int, text: str | None = None) -> bytes:
    """The UTF-8 bytes a token stands for (OpenAI's ``logprobs`` ``bytes``); ``text``: its
    lone decode, where the caller has it already. A token that is part of a multi-byte
    character decodes to U+FFFD; its own bytes come from its vocabulary piece, so a client
    can join the bytes of consecutive tokens into the character."""
    if text is None:
        text = tokenizer.decode([token])
    if "\ufffd" not in text:
        return text.encode()
    piece = tokenizer.convert_ids_to_tokens(token)
    if m := _BYTE_FALLBACK.fullmatch(piece):
        return bytes([int(m[1], 16)])
    byte_of = _byte_of_char()
    if all(c in byte_of for c in piece):
        return bytes(byte_of[c] for c in piece)
    return text.encode()
