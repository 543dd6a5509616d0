"""Which transformer blocks each pipeline stage owns: `split_layers` is the one place that
decides the split, for runs (`trainer.build.stage_layers`) and for plans (`trainer.plan.memory`), from
the explicit `parallelism.pp_layers` or from the cost model (`trainer.plan.cost_model`).

`split_layers` picks contiguous blocks per stage minimising the largest per-stage cost, by
dynamic programming over (stage, blocks used) - exact for that objective:
- `compute`: cost = compute time (the usual balance, as nanotron's block compute costs);
- `memory` (default): cost = (1 - w) C_p / C_ref + w M_p / M_ref, C and M the stage's
  compute and peak memory, normalised by the mean stage of the compute-balanced split, so
  both terms read 1.0 at that split. The first 1F1B stage holds pp micro-batches in flight
  plus the embedding, so it gets fewer blocks.
"""

from __future__ import annotations

from collections.abc import Callable

from trainer.config.mamba import has_mamba
from trainer.config.schema import ModelConfig, ParallelismConfig
from trainer.config.tools import ConfigError
from trainer.plan.cost_model import CostModel

POLICIES = ("memory", "compute")


def ranges_from_counts(counts: list[int]) -> list[range]:
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [range(s, s + n) for s, n in zip(starts, counts)]


def min_max_split(n_blocks: int, stages: int, cost: Callable[[int, int], float], by_start: bool = False) -> list[int]:
    """Blocks per stage (each >= 1, summing to n_blocks) minimising max_p cost(p, n_p); ties
    broken by the smaller sum of squared costs. Dynamic programming, O(stages x n_blocks^2).
    `by_start`: cost(p, n_p, first block of p), for stacks whose blocks differ (hybrids)."""
    if not 1 <= stages <= n_blocks:
        raise ValueError(f"parallelism.pp: expected 1 <= pp <= n_layers={n_blocks}, got {stages}")
    if by_start:
        memo: dict[tuple[int, int, int], float] = {}

        def at(p: int, used: int, n: int) -> float:
            if (p, used, n) not in memo:
                memo[p, used, n] = cost(p, n, used)  # type: ignore[call-arg]
            return memo[p, used, n]
    else:
        table = [[cost(p, n) for n in range(n_blocks + 1)] for p in range(stages)]

        def at(p: int, used: int, n: int) -> float:
            return table[p][n]

    # best[used] = (rounded max, sum of squares, counts) over the stages placed so far
    best: dict[int, tuple[float, float, tuple[int, ...]]] = {0: (0.0, 0.0, ())}
    for p in range(stages):
        left_after = stages - p - 1
        nxt: dict[int, tuple[float, float, tuple[int, ...]]] = {}
        for used, (worst, squares, counts) in best.items():
            for n in range(1, n_blocks - used - left_after + 1):
                c = at(p, used, n)
                cand = (_rounded(max(worst, c)), squares + c * c, counts + (n,))
                key = used + n
                if key not in nxt or cand[:2] < nxt[key][:2]:
                    nxt[key] = cand
        best = nxt
    return list(best[n_blocks][2])


def _rounded(x: float) -> float:
    return float(f"{x:.12g}")


def explicit_split(pp_layers: list[int], n_layers: int, pp: int) -> list[range]:
    if len(pp_layers) != pp:
        raise ConfigError(f"parallelism.pp_layers: expected {pp} entries (one per stage), got {len(pp_layers)}")
    if sum(pp_layers) != n_layers or min(pp_layers) < 1:
        raise ConfigError(
            f"parallelism.pp_layers: expected positive entries summing to model.n_layers={n_layers}, got {pp_layers}"
        )
    return ranges_from_counts(list(pp_layers))


def split_policy(pp_layers: list[int], policy: str | None = None) -> str:
    """How `split_layers` splits: by the cost-model `policy` asked for (`doremi plan --split`);
    without one, "explicit" (`parallelism.pp_layers`) when given, else "memory"."""
    if policy is None:
        return "explicit" if pp_layers else "memory"
    return policy


def split_layers(
    model_cfg: ModelConfig,
    par_cfg: ParallelismConfig,
    micro_batch_size: int,
    seq_len: int,
    *,
    micro_batches: int | None = None,
    policy: str | None = None,
    memory_weight: float = 0.5,
    param_precision: str = "fp32",
) -> list[range]:
    """Global block indices of each pipeline stage, split as `split_policy(par_cfg.pp_layers,
    policy)` says: `par_cfg.pp_layers`, or the split minimising the largest per-stage cost
    under the policy (see the module docstring); with pp = 1 the one stage holds every block.

    `micro_batches` (per dp rank and step) bounds the micro-batches in flight; default pp."""
    how = split_policy(par_cfg.pp_layers, policy)
    if how == "explicit":
        return explicit_split(par_cfg.pp_layers, model_cfg.n_layers, par_cfg.pp)
    check_policy(how, memory_weight)
    if par_cfg.pp == 1:
        return [range(model_cfg.n_layers)]
    return ranges_from_counts(
        split_counts(
            CostModel.from_config(model_cfg, par_cfg, micro_batch_size, seq_len, micro_batches, param_precision),
            how,
            memory_weight,
        )
    )


def check_policy(policy: str, memory_weight: float) -> None:
    if policy not in POLICIES:
        raise ValueError(f"split policy: expected one of {', '.join(POLICIES)}, got {policy!r}")
    if not 0.0 <= memory_weight <= 1.0:
        raise ValueError(f"split memory_weight: expected a value in [0, 1], got {memory_weight}")


def split_counts(cm: CostModel, policy: str = "memory", memory_weight: float = 0.5) -> list[int]:
    check_policy(policy, memory_weight)
    n, pp = cm.model.n_layers, cm.pp
    hybrid = has_mamba(cm.model)
    balanced = min_max_split(n, pp, cm.stage_flops, by_start=hybrid)
    if policy == "compute" or memory_weight == 0.0:
        return balanced
    starts = [r.start for r in ranges_from_counts(balanced)]
    c_ref = sum(cm.stage_flops(p, k, starts[p] if hybrid else None) for p, k in enumerate(balanced)) / pp
    m_ref = sum(cm.stage_memory(p, k, starts[p] if hybrid else None).total for p, k in enumerate(balanced)) / pp

    def cost(p: int, k: int, first: int | None = None) -> float:
        flops, memory = cm.stage_flops(p, k, first), cm.stage_memory(p, k, first).total
        return (1 - memory_weight) * flops / c_ref + memory_weight * memory / m_ref

    return min_max_split(n, pp, cost, by_start=hybrid)
