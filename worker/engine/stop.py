"""Stop strings: never emitted, also when split across tokens.

Text that could be the start of a stop string is held back until it is known not to be one.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: list[str], include_stop: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        self._held = ""
        self.matched: str | None = None  # the stop string that ended generation

    def feed(self, text: str) -> tuple[str, bool]:
        """Add decoded text; return (text safe to emit, whether a stop string matched)."""
        if not self.stops:
            return text, False
        buffer = self._held + text
        hit = self._earliest(buffer)
        if hit is not None:
            index, stop = hit
            self._held = ""
            self.matched = stop
            return buffer[: index + (len(stop) if self.include_stop else 0)], True
        keep = self._partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """At the end of generation, held-back text is no stop string: release it."""
        held, self._held = self._held, ""
        return held

    def _earliest(self, buffer: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.stops:
            index = buffer.find(stop)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _partial_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of `buffer` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest
