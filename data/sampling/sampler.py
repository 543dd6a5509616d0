"""Global batches drawn from domain weights, reproducible from (seed, step, cursors, deficits).

Per step: the global batch holds `apportion(deficits, weights, B)` sequences of each domain
(data/sampling/apportion.py): each domain carries what it is owed from step to step, so that over any
first T steps its realised count is within one sequence of sum_t B x w_t[i] under fixed weights
(within two when the weights change every step), and a small weight is drawn as often as it
asks, not rounded away. Each domain is read as an endless stream of epochs over its pool (its
training sequences less those held back, data/sampling/holdout.py); epoch e of domain d is the
permutation `default_rng([seed, d, e]).permutation(len(pool_d))`, and the stream position is
the domain's cursor: the number of sequences of that domain drawn before this step. Because the
weights may change every step, the cursors and deficits carry the history; with the step and
the nominal counts (sum_t B x w_t, for reports) they are the whole checkpointable state
(`state_dict`). A resumed run that restores them draws the same batches.

Random draws (`draws="random"`, for methods whose signal needs true draws, such as a bandit's
importance weights): the step's counts are multinomial(B, w_t) from
`default_rng([seed, RANDOM_DRAWS, step])`, so they depend on the seed, the step and the weights
only (the same under every layout and on resume); deficits are left alone, and the sequences
come from the same epoch streams.

Layout: the global batch is ordered by stride interleaving (`interleave`), so every contiguous
slice holds each domain in proportion, up to one sequence. Data-parallel rank r takes the r-th
of dp equal contiguous slices and cuts it into `micro_batches` contiguous micro-batches; their
union is the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from data.errors import DataError
from data.sampling.apportion import apportion, interleave
from data.sampling.weights import check_weights

Item = tuple[int, int]  # (domain index, sequence index)

#: The draw modes, and the tag that separates random draws' generator from the permutations'.
DRAWS = ("exact", "random")
RANDOM_DRAWS = 0x5A3D

__all__ = ["DomainBatchSampler", "Item", "interleave"]


class DomainBatchSampler:
    """`pools[d]`: the sequence indices domain d may draw (default: all of `num_sequences[d]`)."""

    def __init__(
        self, num_sequences: list[int], global_batch_size: int, seed: int, pools: Sequence[np.ndarray] | None = None
    ):
        if global_batch_size < 1:
            raise DataError(f"global_batch_size: expected >= 1, got {global_batch_size}")
        if any(n < 0 for n in num_sequences):
            raise DataError(f"num_sequences: expected counts >= 0, got {num_sequences}")
        if pools is None:
            pools = [np.arange(n, dtype=np.int64) for n in num_sequences]
        if len(pools) != len(num_sequences) or any(
            len(p) and (p.min() < 0 or p.max() >= n) for p, n in zip(pools, num_sequences)
        ):
            raise DataError("sampler pools: expected one array of sequence indices per domain, within range")
        self.pools = [np.asarray(p, dtype=np.int64) for p in pools]
        self.num_sequences = [len(p) for p in self.pools]
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.step = 0
        k = len(num_sequences)
        self.cursors = [0] * k
        self.deficits = [0.0] * k
        self.nominal = [0.0] * k
        #: Sequences of each domain in the step drawn last.
        self.counts = [0] * k
        self._last: tuple[int, np.ndarray, str, list[Item]] | None = None
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def check(self, weights: Sequence[float] | np.ndarray) -> np.ndarray:
        w = check_weights(weights, [str(i) for i in range(len(self.num_sequences))], "sampler weights")
        empty = [i for i, x in enumerate(w) if x > 0 and not self.num_sequences[i]]
        if empty:
            raise DataError(
                f"sampler weights: domain(s) {empty} have weight > 0 but no sequences (fewer tokens than seq_len + 1)"
            )
        return w

    def _permutation(self, domain: int, epoch: int) -> np.ndarray:
        key = (domain, epoch)
        if key not in self._perms:
            for old in [k for k in self._perms if k[0] == domain and k[1] < epoch - 1]:
                del self._perms[old]
            rng = np.random.default_rng([self.seed, domain, epoch])
            self._perms[key] = self.pools[domain][rng.permutation(self.num_sequences[domain])]
        return self._perms[key]

    def stream(self, domain: int, start: int, count: int) -> list[int]:
        """Sequence indices at positions [start, start + count) of the domain's epoch stream."""
        n = self.num_sequences[domain]
        out = []
        pos = start
        while pos < start + count:
            epoch, offset = divmod(pos, n)
            take = min(n - offset, start + count - pos)
            out.extend(int(x) for x in self._permutation(domain, epoch)[offset : offset + take])
            pos += take
        return out

    def step_counts(self, step: int, w: np.ndarray, draws: str) -> list[int]:
        """Sequences of each domain in global batch `step` (advances the deficits when exact)."""
        b = self.global_batch_size
        if draws == "random":
            return [int(c) for c in np.random.default_rng([self.seed, RANDOM_DRAWS, step]).multinomial(b, w)]
        if draws != "exact":
            raise DataError(f"sampler draws: expected one of {', '.join(DRAWS)}, got {draws!r}")
        counts, self.deficits = apportion(self.deficits, w, b)
        return counts

    def global_batch(self, step: int, weights: Sequence[float] | np.ndarray, draws: str = "exact") -> list[Item]:
        """The global batch of `step`, advancing the state. Steps are drawn in order; asking
        again for the step just drawn (same weights) returns it unchanged."""
        w = self.check(weights)
        if self._last is not None and step == self._last[0]:
            if not np.array_equal(w, self._last[1]) or draws != self._last[2]:
                raise DataError(
                    f"sampler: step {step} was drawn with weights {self._last[1].tolist()} ({self._last[2]}), "
                    f"now asked with {w.tolist()} ({draws})"
                )
            return list(self._last[3])
        if step != self.step:
            raise DataError(
                f"sampler: next step is {self.step}, asked for step {step}; restore the "
                f"sampler state (load_state_dict) to resume at another step"
            )
        b = self.global_batch_size
        counts = self.step_counts(step, w, draws)
        streams = {d: iter(self.stream(d, self.cursors[d], c)) for d, c in enumerate(counts) if c}
        batch = [(d, next(streams[d])) for d in interleave(counts)]
        for d, c in enumerate(counts):
            self.cursors[d] += c
            self.nominal[d] += b * float(w[d])
        self.counts = counts
        self.step += 1
        self._last = (step, w, draws, batch)
        return list(batch)

    @property
    def last_batch(self) -> list[Item]:
        """The global batch drawn last (empty before the first step)."""
        return [] if self._last is None else list(self._last[3])

    def local(
        self,
        step: int,
        weights: Sequence[float] | np.ndarray,
        dp_rank: int,
        dp: int,
        micro_batches: int,
        draws: str = "exact",
    ) -> list[list[Item]]:
        """This data-parallel rank's micro-batches of the global batch of `step`."""
        b = self.global_batch_size
        if dp < 1 or micro_batches < 1 or b % (dp * micro_batches):
            raise DataError(
                f"sampler: global_batch_size {b} is not a multiple of dp x micro_batches = {dp} x {micro_batches}"
            )
        if not 0 <= dp_rank < dp:
            raise DataError(f"sampler: dp_rank {dp_rank} outside [0, {dp})")
        batch = self.global_batch(step, weights, draws)
        per_rank = b // dp
        mine = batch[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        size = per_rank // micro_batches
        return [mine[m * size : (m + 1) * size] for m in range(micro_batches)]

    def epochs(self) -> list[float]:
        """Epochs consumed per domain so far (cursor / pool size; 0 for an empty domain)."""
        return [c / n if n else 0.0 for c, n in zip(self.cursors, self.num_sequences)]

    def drawn(self) -> list[int]:
        """Sequences drawn per domain since step 0 (the realised mixture, in sequences)."""
        return list(self.cursors)

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "cursors": list(self.cursors),
            "deficits": list(self.deficits),
            "nominal": list(self.nominal),
            "seed": self.seed,
            "num_sequences": list(self.num_sequences),
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "num_sequences", "global_batch_size"):
            if state.get(key) != getattr(self, key):
                raise DataError(
                    f"sampler state: {key} is {state.get(key)!r} in the checkpoint but "
                    f"{getattr(self, key)!r} now; resume with the same data, holdout and batch size"
                )
        k = len(self.num_sequences)
        for key in ("cursors", "deficits", "nominal"):
            if key not in state:
                raise DataError(
                    f"sampler state: no {key!r} (a checkpoint of an older sampler, which rounded "
                    f"each step's mixture afresh); start the run again"
                )
            if len(state[key]) != k:
                raise DataError(f"sampler state: {len(state[key])} {key} for {k} domains")
        self.step = int(state["step"])
        self.cursors = [int(c) for c in state["cursors"]]
        self.deficits = [float(x) for x in state["deficits"]]
        self.nominal = [float(x) for x in state["nominal"]]
        self._last = None
