"""Progress of the long stages on stderr, at most one report every few seconds.

`Progress`: throughput of `doremi preprocess` while it tokenizes: tokens and UTF-8 bytes per
second, per domain and overall (issue 42 point 2: a build of hundreds of GB runs for hours, and
its speed is what says whether to add nodes). `Countdown`: i of n units of any other stage (a
sweep's runs, an evaluation's domains, `doremi score`'s batches) with the time spent and left
(issue 43 item 3: a 12-run sweep printed nothing for 4.5 minutes).

The counts come from the process that tokenizes (`add`) or, for worker processes, from shared
counters that the parent reads (`absorb`). Lines go to stderr, never stdout, whose last lines
`doremi preprocess` keeps for its summary. `DOREMI_PROGRESS_SECONDS` sets the interval (0: off);
under pytest the default is off, so that tests' captured output does not depend on speed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
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


def duration(seconds: float) -> str:
    """42 -> '42 s', 185 -> '3m 05s', 7320 -> '2h 02m'."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"


class Countdown:
    """`label i/n what: T elapsed, ETA R` when `interval` seconds have passed since the last
    line (or the start). The ETA extrapolates the units done since the start: `first` units
    were done before (a resumed sweep), so they count in i but not in the rate."""

    def __init__(
        self,
        label: str,
        total: int,
        first: int = 0,
        stream: TextIO | None = None,
        interval: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.label, self.total, self.first = label, total, first
        self.stream = stream
        self.interval = interval_from_env() if interval is None else interval
        self.clock = clock
        self.start = self._last = clock()

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    def line(self, done: int, what: str, now: float) -> str:
        elapsed = now - self.start
        rate = (done - self.first) / elapsed if elapsed > 0 else 0.0
        eta = duration((self.total - done) / rate) if rate > 0 else "?"
        named = f" {what}" if what else ""
        return f"{self.label} {done}/{self.total}{named}: {duration(elapsed)} elapsed, ETA {eta}"

    def done(self, done: int, what: str = "") -> None:
        """`done` of `total` units are finished, the last one named `what`."""
        if not self.enabled:
            return
        now = self.clock()
        if now - self._last < self.interval:
            return
        print(self.line(done, what, now), file=self.stream or sys.stderr, flush=True)
        self._last = now


@contextlib.contextmanager
def datasets_bars(enabled: bool) -> Iterator[None]:
    """`datasets`' own tqdm bars ("Downloading data", "Generating train split") off inside the
    block unless `enabled` (then left as they are: an outer block may have turned them off), and
    restored after: off for local files, whose "download" is a copy into the Arrow cache and says
    nothing a researcher needs (issue 43 item 4); a hub download keeps them."""
    try:
        import datasets
    except ImportError:  # JSON lines and the embedded corpus are read without it
        datasets = None
    if enabled or datasets is None or not datasets.is_progress_bar_enabled():
        yield
        return
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.enable_progress_bars()
