"""Stop strings: a request ends at the first token whose decoded output contains one of them.

Why: RL rollouts of reasoning and tool-use tasks end on text ("</answer>", a code fence), not on
one token id: the same text tokenizes many ways. The check runs on the host when a token is
applied (as the stop-token check does), only for requests that have stop strings, and decodes
only a window of their last tokens: enough tokens for the longest stop string even when every
character takes four byte tokens (byte-level tokenizers), so the cost per token does not grow
with the output — and for most tokens not even that: a token whose own text holds no stop
string's last character (and no part of a character) cannot have completed one, so one token
is decoded (0.43 µs a request and token on the CPU machine against 1.1-8.5 µs for the window,
benchmarks/stop_strings_check.py). The tokens and logprobs returned end with the token that
completed the stop string (what the trainer needs: every sampled token with its logprob); the
text is the decode of those tokens, stop string included.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

MAX_TOKENS_PER_CHAR = 4  # a UTF-8 character is at most four bytes: four byte-level tokens
WINDOW_SLACK = 4  # tokens more, for a character cut at the window's start


class StopStrings:
    """A request's stop strings with the tokenizer that decodes its output (shared by the
    requests of one SamplingParams; it holds no per-request state)."""

    def __init__(self, tokenizer: Any, stops: Sequence[str]):
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.window = MAX_TOKENS_PER_CHAR * max(map(len, self.stops)) + WINDOW_SLACK
        self.last_chars = frozenset(stop[-1] for stop in self.stops)
        # a decoder may drop a token's leading space when it stands alone (SentencePiece)
        self.ends_in_space = any(c.isspace() for c in self.last_chars)

    def match(self, output_ids: list[int]) -> Optional[str]:
        """The stop string the output, its last token just applied, now contains (the first of
        them in the given order), or None. Checked after every token, so the first token that
        completes one is the one that ends the request."""
        if not self._may_complete(output_ids[-1]):
            return None
        text = self.tokenizer.decode(output_ids[-self.window:])
        return next((stop for stop in self.stops if stop in text), None)

    def _may_complete(self, token: int) -> bool:
        """False when the last token cannot have completed a stop string: its own text is not
        empty, holds no part of a character (U+FFFD) and no stop string's last character.
        One token decoded instead of the window for most tokens."""
        if self.ends_in_space:
            return True
        text = self.tokenizer.decode([token])
        return not text or "\ufffd" in text or not self.last_chars.isdisjoint(text)
