"""Stop strings over streamed text: what is safe to emit now, and whether a stop string was hit.

A stop string may arrive split over several text deltas. The checker emits text as soon as it cannot
be part of a stop string, holds back the longest tail that is the beginning of one, and on a match
emits only the text before it (the stop string and everything after it are dropped), or with `include`
(vLLM's include_stop_str_in_output) the text up to the stop string's end.
"""
from __future__ import annotations


class StopChecker:
    """push(delta) -> (text safe to emit, stopped); flush() -> held-back text when the sequence ends
    for another reason. After a stop, push returns ("", True). `matched` is the stop string hit."""

    __slots__ = ("stop", "include", "matched", "_held", "_done")

    def __init__(self, stop: list[str], include: bool = False):
        self.stop = [s for s in stop if s]
        self.include = include
        self.matched: str | None = None
        self._held = ""
        self._done = False

    @property
    def stopped(self) -> bool:
        return self._done

    @property
    def held_chars(self) -> int:
        """Characters held back (they may begin a stop string): emitted, if at all, by a later push."""
        return len(self._held)

    def push(self, delta_text: str, may_stop: bool = True) -> tuple[str, bool]:
        """may_stop=False (under min_tokens): a stop string is text like any other, but the tail that may
        begin one is still held, so that one completed once stopping is allowed is caught whole."""
        if not self.stop:
            return delta_text, False
        if self._done:
            return "", True
        if not delta_text:
            return "", False
        # The held text is shorter than every stop string it begins; a match counts only if it ends
        # inside delta_text (one in the held text was passed under min_tokens), and text before the
        # held part was already safe.
        buf = self._held + delta_text
        first, hit = -1, None
        for s in self.stop if may_stop else ():   # the earliest; of two there, the one that ends first
            i = buf.find(s, max(0, len(self._held) - len(s) + 1))
            if i >= 0 and (first < 0 or i < first or (i == first and len(s) < len(hit))):
                first, hit = i, s
        if hit is not None:
            self._done, self.matched, self._held = True, hit, ""
            return buf[:first + len(hit) if self.include else first], True
        keep = self._longest_partial(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _longest_partial(self, buf: str) -> int:
        """Length of the longest tail of buf that is a proper beginning of some stop string."""
        best = 0
        last = buf[-1]
        for s in self.stop:
            # candidate lengths k: s[k - 1] == buf[-1], longest first, k < len(s) and k <= len(buf)
            k = min(len(s) - 1, len(buf))
            while k > best:
                k = s.rfind(last, 0, k) + 1
                if k <= best:
                    break
                if buf.endswith(s[:k]):
                    best = k
                    break
                k -= 1
        return best
