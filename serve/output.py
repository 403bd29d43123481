"""Engine text -> the text a client may see, chunk by chunk.

`Engine.stream` yields text deltas as device chunks complete and cuts its final text at the first
stop string; its final text also ends with the text of the stop token that ended generation
(`<|role_end|>`, ...). `CompletionText` turns that into client text:
- while streaming it holds back a suffix that could still become a stop string, so text that the
  final result cuts away is never sent;
- at the end it takes the engine's final text, drops a trailing stop-token text, and returns what
  was not sent yet.
"""
from __future__ import annotations

from collections.abc import Sequence


def _stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `stops`."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class CompletionText:
    def __init__(self, stops: Sequence[str] = (), stop_token_text=None):
        """stop_token_text(token_id) -> the text of that token if it is a stop token, else None."""
        self.stops = [s for s in stops if s]
        self.stop_token_text = stop_token_text
        self._acc = ""      # all engine text so far
        self.sent = ""      # text handed out so far

    def feed(self, delta: str) -> str:
        """A streamed engine delta -> the part that is safe to send now (maybe '')."""
        self._acc += delta
        safe = len(self._acc) - _stop_prefix_len(self._acc, self.stops)
        if safe <= len(self.sent):
            return ""
        out = self._acc[len(self.sent):safe]
        self.sent += out
        return out

    def final_text(self, text: str | None, token_ids: Sequence[int], finish_reason: str | None) -> str:
        """The engine's final text without the text of a trailing stop token."""
        text = text or ""
        if finish_reason == "stop" and token_ids and self.stop_token_text is not None:
            tail = self.stop_token_text(token_ids[-1])
            if tail and text.endswith(tail):
                text = text[:-len(tail)]
        return text

    def finish(self, text: str | None, token_ids: Sequence[int], finish_reason: str | None) -> str:
        """The final result -> the text not sent yet."""
        final = self.final_text(text, token_ids, finish_reason)
        if not final.startswith(self.sent):  # cannot happen with Engine.stream; never resend
            common = 0
            while common < min(len(final), len(self.sent)) and final[common] == self.sent[common]:
                common += 1
            final = self.sent + final[common:]
        out = final[len(self.sent):]
        self.sent = final
        return out
