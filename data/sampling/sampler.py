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
the nominal counts (sum_t B x w_t, w_t as drawn, after the caps below; for reports) they are the
whole checkpointable state (`state_dict`). A resumed run that restores them draws the same
batches.

Random draws (`draws="random"`, for methods whose signal needs true draws, such as a bandit's
importance weights): the step's counts are multinomial(B, w_t) from
`default_rng([seed, RANDOM_DRAWS, step])`, so they depend on the seed, the step and the weights
only (the same under every layout and on resume); deficits are left alone, and the sequences
come from the same epoch streams.

Epoch caps (`caps`, from `data.max_epochs`: `cursor_caps`): a domain's cursor never passes its
cap, whatever the weights ask, so a mixture a method changes during the run reads no domain more
than `max_epochs` epochs (a fixed mixture is capped ahead of the run by
data/sampling/mixtures.py `sequence_capped`, within which these caps never bind). A domain whose
remaining allowance is smaller than what the step asks of it gets only what is left, and the
freed share goes to the other domains in proportion to their weights: proportional because that
is how the fixed mixtures are capped (`epoch_capped`), so a capped domain moves the others' ratios
no more than the weights themselves say, and a method's own preference among the domains it can
still read is kept. Exact draws pass the remaining allowance to `apportion` as each domain's room
(the slots a full domain would take go by the chairman rule to the others, whose deficits grow
with their weights); from the next step an exhausted domain's weight and what it was still owed
are spread over the others in proportion. Random draws are multinomial with the weights capped at
remaining / B (`capped_share`), and a draw past the room (sampling noise) is redrawn over the
domains with room, in proportion to their weights. Which domains are exhausted follows from the
cursors, so a resumed run draws the same batches; the step at which each was exhausted is kept for
the reports. Where the domains with weight have no room left the batch goes to the others in
proportion to what they have left; where every pool together holds less than one global batch the
step stops with a DataError.

Layout: the global batch is ordered by stride interleaving (`interleave`), so every contiguous
slice holds each domain in proportion, up to one sequence. Data-parallel rank r takes the r-th
of dp equal contiguous slices and cuts it into `micro_batches` contiguous micro-batches; their
union is the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from data.errors import DataError
from data.sampling.apportion import apportion, interleave
from data.sampling.mixtures import epoch_capped
from data.sampling.weights import check_weights

Item = tuple[int, int]  # (domain index, sequence index)

#: The draw modes, and the tag that separates random draws' generator from the permutations'.
DRAWS = ("exact", "random")
RANDOM_DRAWS = 0x5A3D

__all__ = ["DomainBatchSampler", "Item", "capped_share", "cursor_caps", "interleave"]


def cursor_caps(pools: Sequence[int], max_epochs: float) -> list[int]:
    """Per domain, the most sequences a run may draw under `data.max_epochs`: floor(max_epochs x
    pool), epochs being sequences over the domain's pool (as `epochs` counts them)."""
    if not 0 < max_epochs < math.inf:
        raise DataError(f"max_epochs: expected a finite value > 0, got {max_epochs!r}")
    return [math.floor(max_epochs * n) for n in pools]


def capped_share(weights: np.ndarray, room: Sequence[int], total: int) -> np.ndarray:
    """Each domain's share of `total` random draws when domain i may take at most room[i]: a
    domain asked more than its room gets room / total and the freed share goes to the others in
    proportion to their weights (`epoch_capped`, the fixed mixtures' cap); where the domains with
    weight cannot hold `total` together, the rest goes to the others in proportion to their room.
    `weights` come back unchanged where no room binds. The rooms must sum to at least `total`."""
    r = np.asarray(room, dtype=np.float64)
    if np.all(total * weights <= r):
        return weights
    read = weights > 0
    if r[read].sum() >= total:
        return epoch_capped(weights, r, float(total), 1.0)
    share = np.where(read, r / total, 0.0)
    rest = np.where(read, 0.0, r)
    return share + rest / rest.sum() * (1.0 - share.sum())


def _random_capped(rng: np.random.Generator, share: np.ndarray, room: Sequence[int], total: int) -> list[int]:
    """multinomial(total, share), with any count past its room cut to it and the excess drawn
    again over the domains with room left, in proportion to `share` (to the room left where none
    of them has a share); at most k rounds, each closing the domains it filled."""
    r = np.asarray(room, dtype=np.int64)
    counts = rng.multinomial(total, share).astype(np.int64)
    while (over := counts > r).any():
        excess = int((counts - r)[over].sum())
        counts = np.minimum(counts, r)
        open_ = counts < r
        p = np.where(open_, share, 0.0)
        if not p.sum() > 0:
            p = np.where(open_, r - counts, 0).astype(np.float64)
        counts += rng.multinomial(excess, p / p.sum())
    return [int(c) for c in counts]


class DomainBatchSampler:
    """`pools[d]`: the sequence indices domain d may draw (default: all of `num_sequences[d]`).
    `caps[d]`: the most sequences of domain d the run may draw (`cursor_caps`; None: no cap).
    `names`: the domains' names, for messages."""

    def __init__(
        self,
        num_sequences: list[int],
        global_batch_size: int,
        seed: int,
        pools: Sequence[np.ndarray] | None = None,
        caps: Sequence[int] | None = None,
        names: Sequence[str] | None = None,
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
        if caps is not None and (len(caps) != k or any(c < 0 for c in caps)):
            raise DataError(f"sampler caps: expected one count >= 0 per domain, got {list(caps)}")
        self.caps = None if caps is None else [int(c) for c in caps]
        self.names = [str(i) for i in range(k)] if names is None else list(names)
        #: The weights the step drawn last was drawn with: those asked for, less what the caps moved.
        self.weights = np.zeros(k)
        #: Whether the caps moved the weights of the step drawn last.
        self.capped = False
        #: Domain -> the step (global batches drawn) whose draw took it to its cap.
        self.exhausted: dict[int, int] = {}
        #: Domains the step drawn last took to their cap.
        self.newly_exhausted: list[int] = []
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

    def room(self) -> list[int] | None:
        """Sequences each domain may still draw before its cap (None without caps)."""
        if self.caps is None:
            return None
        return [max(c - n, 0) for c, n in zip(self.caps, self.cursors)]

    def step_counts(self, step: int, w: np.ndarray, draws: str) -> tuple[list[int], np.ndarray]:
        """(sequences of each domain in global batch `step`, the weights they were drawn with);
        advances the deficits when exact."""
        b = self.global_batch_size
        if draws not in DRAWS:
            raise DataError(f"sampler draws: expected one of {', '.join(DRAWS)}, got {draws!r}")
        room = self.room()
        if room is not None and sum(room) < b:
            left = ", ".join(f"{n} {r}" for n, r in zip(self.names, room))
            raise DataError(
                f"data.max_epochs: at step {step + 1} the pools have {sum(room)} sequences left under their "
                f"epoch caps ({left}), fewer than the global batch of {b}: the run asks for more data "
                f"than the pools hold at max_epochs"
            )
        if draws == "random":
            rng = np.random.default_rng([self.seed, RANDOM_DRAWS, step])
            if room is None:
                return [int(c) for c in rng.multinomial(b, w)], w
            share = capped_share(w, room, b)
            return _random_capped(rng, share, room, b), share
        used = w if room is None else self._exact_weights(w, room)
        counts, self.deficits = apportion(self.deficits, used, b, room)
        return counts, used

    def _exact_weights(self, w: np.ndarray, room: list[int]) -> np.ndarray:
        """`w` less the exhausted domains (no room left): their weight is spread over the others
        in proportion to theirs (to the others' room where none of them has weight), and so is
        what they were still owed (their deficits), so that the deficits keep summing to 0 over
        the domains that can still be drawn, as `apportion` assumes. Unchanged while none is
        exhausted."""
        dead = np.asarray(room) <= 0
        if not dead.any():
            return w
        used = w
        if (w[dead] > 0).any():
            used = np.where(dead, 0.0, w)
            if not used.sum() > 0:
                used = np.where(dead, 0.0, np.asarray(room, dtype=np.float64))
            used = used / used.sum()
        owed = [self.deficits[d] for d in np.flatnonzero(dead)]
        if any(owed):
            spread = used / used.sum()
            self.deficits = [0.0 if dead[i] else x + sum(owed) * float(spread[i]) for i, x in enumerate(self.deficits)]
        return used

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
        counts, used = self.step_counts(step, w, draws)
        streams = {d: iter(self.stream(d, self.cursors[d], c)) for d, c in enumerate(counts) if c}
        batch = [(d, next(streams[d])) for d in interleave(counts)]
        for d, c in enumerate(counts):
            self.cursors[d] += c
            self.nominal[d] += b * float(used[d])
        self.counts = counts
        self.weights, self.capped = used, used is not w
        self.step += 1
        self.newly_exhausted = []
        if self.caps is not None:
            self.newly_exhausted = [d for d, c in enumerate(counts) if c and self.cursors[d] >= self.caps[d]]
            self.exhausted.update((d, self.step) for d in self.newly_exhausted)
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
        state = {
            "step": self.step,
            "cursors": list(self.cursors),
            "deficits": list(self.deficits),
            "nominal": list(self.nominal),
            "seed": self.seed,
            "num_sequences": list(self.num_sequences),
            "global_batch_size": self.global_batch_size,
        }
        if self.caps is not None:  # for the reports only: the draws follow from the cursors
            state["exhausted"] = [self.exhausted.get(d) for d in range(len(self.caps))]
        return state

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
        self.newly_exhausted = []
        if self.caps is not None:
            # A checkpoint written without caps: the domains already at their cap, by its step.
            room = self.room() or []
            at = state.get("exhausted") or [self.step if r == 0 and c else None for r, c in zip(room, self.caps)]
            self.exhausted = {d: int(s) for d, s in enumerate(at) if s is not None}
