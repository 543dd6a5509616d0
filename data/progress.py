"""Throughput of `doremi preprocess` while it tokenizes: tokens and UTF-8 bytes per second, per
domain and overall, one block of lines on stderr at most every few seconds (issue 42 point 2: a
build of hundreds of GB runs for hours, and its speed is what says whether to add nodes).

The counts come from the process that tokenizes (`add`) or, for worker processes, from shared
counters that the parent reads (`absorb`). Lines go to stderr, never stdout, whose last lines
`doremi preprocess` keeps for its summary. `DOREMI_PROGRESS_SECONDS` sets the interval (0: off);
under pytest the default is off, so that tests' captured output does not depend on speed.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import TextIO

DEFAULT_SECONDS = 5.0
ENV = "DOREMI_PROGRESS_SECONDS"


def interval_from_env(environ: dict[str, str] | None = None) -> float:
    """Seconds between reports: $DOREMI_PROGRESS_SECONDS, else 5 (0 under pytest)."""
    env = os.environ if environ is None else environ
    if ENV in env:
        try:
            return max(0.0, float(env[ENV]))
        except ValueError:
            return DEFAULT_SECONDS
    return 0.0 if "PYTEST_CURRENT_TEST" in env else DEFAULT_SECONDS


def si(value: float, unit: str) -> str:
    """(1234567, 'B') -> '1.23 MB'; below 1000 the number itself ('999 B')."""
    for prefix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {prefix}{unit}"
    return f"{value:.0f} {unit}"


def rate_line(name: str, tokens: int, nbytes: int, d_tokens: int, d_bytes: int, seconds: float) -> str:
    """`name: T tok (R tok/s), B (S/s)`: totals, and rates over the last `seconds`."""
    s = max(seconds, 1e-9)
    return f"{name}: {si(tokens, 'tok')} ({si(d_tokens / s, 'tok')}/s), {si(nbytes, 'B')} ({si(d_bytes / s, 'B')}/s)"


class Progress:
    """Counts per domain; `tick` prints when `interval` seconds have passed since the last print."""

    def __init__(
        self,
        domains: Sequence[str],
        stream: TextIO | None = None,
        interval: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.domains = list(domains)
        self.index = {d: i for i, d in enumerate(self.domains)}
        self.stream = stream
        self.interval = interval_from_env() if interval is None else interval
        self.clock = clock
        self.counts = [0] * (2 * len(self.domains))  # tokens, bytes of each domain
        self._absorbed = [0] * len(self.counts)
        self._shown = list(self.counts)
        self.start = self._last = clock()

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def add(self, domain: str, tokens: int, nbytes: int) -> None:
        i = self.index[domain]
        self.counts[2 * i] += tokens
        self.counts[2 * i + 1] += nbytes
        self.tick()

    def absorb(self, shared: Sequence[int]) -> None:
        """Counters of worker processes (the same layout as `counts`, cumulative)."""
        for k, v in enumerate(shared):
            self.counts[k] += v - self._absorbed[k]
            self._absorbed[k] = v
        self.tick()

    def lines(self, now: float) -> list[str]:
        seconds = now - self._last
        c, s = self.counts, self._shown
        out = [
            f"preprocess {now - self.start:.0f} s: "
            + rate_line(
                "all", sum(c[::2]), sum(c[1::2]), sum(c[::2]) - sum(s[::2]), sum(c[1::2]) - sum(s[1::2]), seconds
            )
        ]
        for i, d in enumerate(self.domains):
            if c[2 * i] != s[2 * i] or c[2 * i + 1] != s[2 * i + 1]:
                t, b = 2 * i, 2 * i + 1
                out.append("  " + rate_line(d, c[t], c[b], c[t] - s[t], c[b] - s[b], seconds))
        return out

    def tick(self) -> None:
        if not self.enabled:
            return
        now = self.clock()
        if now - self._last < self.interval:
            return
        stream = self.stream or sys.stderr
        print("\n".join(self.lines(now)), file=stream, flush=True)
        self._shown, self._last = list(self.counts), now
