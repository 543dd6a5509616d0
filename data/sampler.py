"""Global batches drawn from domain weights, reproducible from (seed, step, cursors).

Per step: the global batch holds exactly `largest_remainder(weights, B)` sequences of each
domain. Each domain is read as an endless stream of epochs; epoch e of domain d is the
permutation `default_rng([seed, d, e]).permutation(n_d)`, and the stream position is the
domain's cursor: the number of sequences of that domain drawn before this step. Because the
weights may change every step, the cursors carry the history; they (and the step) are the whole
checkpointable state (`state_dict`). A resumed run that restores them draws the same batches.

Layout: the global batch is ordered by stride interleaving (the j-th of c_d draws of domain d
sits at (j + 1/2) / c_d of the batch), so every contiguous slice holds each domain in
proportion, up to one sequence. Data-parallel rank r takes the r-th of dp equal contiguous
slices and cuts it into `micro_batches` contiguous micro-batches; their union is the batch.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from data.errors import DataError
from data.weights import check_weights

Item = tuple[int, int]  # (domain index, sequence index)


def largest_remainder(weights: Sequence[float] | np.ndarray, total: int) -> list[int]:
    """Integer counts summing to `total`: floor(w_i x total), then one more for the largest
    fractional parts (ties: lower domain index). `weights` must sum to 1."""
    quotas = np.asarray(weights, dtype=np.float64) * total
    base = np.floor(quotas + 1e-9).astype(np.int64)
    frac = np.round(quotas - base, 9)
    left = total - int(base.sum())
    order = sorted(range(len(base)), key=lambda i: (-frac[i], i))
    for i in order[:max(left, 0)]:
        base[i] += 1
    return [int(c) for c in base]


def interleave(counts: Sequence[int]) -> list[int]:
    """Domain index at each batch position: draw j of domain d at key (2j + 1) / (2 c_d),
    sorted (ties: lower domain index). Equal rationals give equal floats, so ties are exact."""
    keys = [((2 * j + 1) / (2 * c), d) for d, c in enumerate(counts) for j in range(c)]
    return [d for _, d in sorted(keys)]


class DomainBatchSampler:
    def __init__(self, num_sequences: list[int], global_batch_size: int, seed: int):
        if global_batch_size < 1:
            raise DataError(f"global_batch_size: expected >= 1, got {global_batch_size}")
        if any(n < 0 for n in num_sequences):
            raise DataError(f"num_sequences: expected counts >= 0, got {num_sequences}")
        self.num_sequences = list(num_sequences)
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.step = 0
        self.cursors = [0] * len(num_sequences)
        self._last: tuple[int, list[int], list[Item]] | None = None
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def counts(self, weights: Sequence[float] | np.ndarray) -> list[int]:
        """Sequences per domain in one global batch (largest-remainder rounding of w x B)."""
        w = check_weights(weights, [str(i) for i in range(len(self.num_sequences))], "sampler weights")
        counts = largest_remainder(w, self.global_batch_size)
        empty = [i for i, c in enumerate(counts) if c and not self.num_sequences[i]]
        if empty:
            raise DataError(f"sampler weights: domain(s) {empty} have weight > 0 but no sequences "
                            f"(fewer tokens than seq_len + 1)")
        return counts

    def _permutation(self, domain: int, epoch: int) -> np.ndarray:
        key = (domain, epoch)
        if key not in self._perms:
            for old in [k for k in self._perms if k[0] == domain and k[1] < epoch - 1]:
                del self._perms[old]
            rng = np.random.default_rng([self.seed, domain, epoch])
            self._perms[key] = rng.permutation(self.num_sequences[domain])
        return self._perms[key]

    def stream(self, domain: int, start: int, count: int) -> list[int]:
        """Sequence indices at positions [start, start + count) of the domain's epoch stream."""
        n = self.num_sequences[domain]
        out = []
        pos = start
        while pos < start + count:
            epoch, offset = divmod(pos, n)
            take = min(n - offset, start + count - pos)
            out.extend(int(x) for x in self._permutation(domain, epoch)[offset:offset + take])
            pos += take
        return out

    def global_batch(self, step: int, weights: Sequence[float] | np.ndarray) -> list[Item]:
        """The global batch of `step`, advancing the cursors. Steps are drawn in order; asking
        again for the step just drawn (same counts) returns it unchanged."""
        counts = self.counts(weights)
        if self._last is not None and step == self._last[0]:
            if counts != self._last[1]:
                raise DataError(f"sampler: step {step} was drawn with counts {self._last[1]}, now asked "
                                f"with {counts}")
            return list(self._last[2])
        if step != self.step:
            raise DataError(f"sampler: next step is {self.step}, asked for step {step}; restore the "
                            f"sampler state (load_state_dict) to resume at another step")
        draws = {d: iter(self.stream(d, self.cursors[d], c)) for d, c in enumerate(counts) if c}
        batch = [(d, next(draws[d])) for d in interleave(counts)]
        for d, c in enumerate(counts):
            self.cursors[d] += c
        self.step += 1
        self._last = (step, counts, batch)
        return list(batch)

    def local(self, step: int, weights: Sequence[float] | np.ndarray, dp_rank: int, dp: int,
              micro_batches: int) -> list[list[Item]]:
        """This data-parallel rank's micro-batches of the global batch of `step`."""
        b = self.global_batch_size
        if dp < 1 or micro_batches < 1 or b % (dp * micro_batches):
            raise DataError(f"sampler: global_batch_size {b} is not a multiple of dp x micro_batches = "
                            f"{dp} x {micro_batches}")
        if not 0 <= dp_rank < dp:
            raise DataError(f"sampler: dp_rank {dp_rank} outside [0, {dp})")
        batch = self.global_batch(step, weights)
        per_rank = b // dp
        mine = batch[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        size = per_rank // micro_batches
        return [mine[m * size:(m + 1) * size] for m in range(micro_batches)]

    def skip_to(self, step: int, weights: Sequence[float] | np.ndarray) -> None:
        """Advance the cursors to `step` as if steps self.step .. step-1 had been drawn with
        constant `weights`, without drawing them (resuming a fixed-weights run without sampler
        state)."""
        if step < self.step:
            raise DataError(f"sampler: cannot skip back from step {self.step} to {step}")
        counts = self.counts(weights)
        self.cursors = [c + (step - self.step) * k for c, k in zip(self.cursors, counts)]
        self.step = step
        self._last = None

    def epochs(self) -> list[float]:
        """Epochs consumed per domain so far (cursor / sequences; 0 for an empty domain)."""
        return [c / n if n else 0.0 for c, n in zip(self.cursors, self.num_sequences)]

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "cursors": list(self.cursors), "seed": self.seed,
                "num_sequences": list(self.num_sequences), "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "num_sequences", "global_batch_size"):
            if state.get(key) != getattr(self, key):
                raise DataError(f"sampler state: {key} is {state.get(key)!r} in the checkpoint but "
                                f"{getattr(self, key)!r} now; resume with the same data and batch size")
        if len(state["cursors"]) != len(self.num_sequences):
            raise DataError(f"sampler state: {len(state['cursors'])} cursors for {len(self.num_sequences)} domains")
        self.step = int(state["step"])
        self.cursors = [int(c) for c in state["cursors"]]
        self._last = None
