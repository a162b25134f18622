"""Stop strings matched on decoded text across token boundaries, with streaming hold-back."""

from __future__ import annotations


class StopMatcher:
    """Feed text deltas; get back what is safe to emit now.

    Text that could still be the start of a stop string is held back until it either completes the stop
    (then it is dropped and everything after it too) or can no longer match (then it is released).
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.buf = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        self.buf += text
        hits = [(self.buf.find(s), s) for s in self.stops]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            idx, s = min(hits)
            out, self.buf = self.buf[:idx], ""
            self.stopped, self.matched = True, s
            return out
        hold = self._held_suffix_len()
        out = self.buf[: len(self.buf) - hold]
        self.buf = self.buf[len(self.buf) - hold:]
        return out

    def _held_suffix_len(self) -> int:
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.buf)), best, -1):
                if self.buf.endswith(s[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """End of generation without a stop: release whatever was held."""
        out, self.buf = ("" if self.stopped else self.buf), ""
        return out
