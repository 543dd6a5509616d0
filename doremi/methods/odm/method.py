"""ODM: online data mixing with the EXP3 bandit over domains (Albalak, Pan, Raffel and Wang 2023,
"Efficient Online Data Mixing For Language Model Pre-Training", arXiv 2312.02406, Algorithm 1).

The main model is trained on data drawn from the bandit's policy; each domain is an arm and its
reward is its training loss, so no reference model and no extra forward pass is needed. With K
domains, smoothing alpha and estimated rewards R_hat (0 at the start), step t (1-based) is

    eps_t         = min(1/K, sqrt(ln K / (K t)))                 (eps_0 = 1/K)
    pi_t(i)       = (1 - K eps_t) exp(eps_{t-1} R_hat_i) / sum_j exp(eps_{t-1} R_hat_j) + eps_t
    draw the batch from pi_t, train on it
    R_hat_i      <- alpha R_hat_i + (1 - alpha) L_i / pi_t(i)    for every domain i drawn at step t

The paper pulls one arm per step. Here each of the B sequences of the global batch draws its
domain independently from pi_t (`Needs(draws="random")`), as in the authors' mixed mini-batches,
so a step pulls several arms at once. The multi-draw rule: every domain drawn this step (with
non-masked tokens) gets the reward L_i / pi_t(i), L_i being its mean training loss per token over
the global batch (`StepSignals.domain_loss`), folded in once per step; a domain not drawn keeps
its R_hat. The weights logged for step t (`weights`) are pi_{t+1}, the policy after the update;
`sampling` is pi_t as drawn: under `data.max_epochs` a domain read to its cap gets no more
draws and its share goes to the others (data/sampling/sampler.py), and pi_t(i) is then the
probability the sequences were actually drawn with (`StepSignals.weights`), not the policy's.

The authors' code (github alon-albalak/online-data-mixing, `megatron/data/data_sampling_utils.py`,
`SmoothedMeanWeightUpdater`, which its README names the paper's method, and `Exp3WeightUpdater`)
differs from the paper in ways that are options here (defaults: the paper):
- `reward: exp_loss`: the reward is exp(L_i) (the per-domain perplexity), and
  `importance_weighting: false`: it is not divided by pi_t(i) (both as in `SmoothedMeanWeightUpdater`).
- `policy: linear`: its mixed-batch update (its single-domain one keeps the softmax) normalises R_hat linearly,
  pi(i) = (1 - K eps) R_hat_i / sum_j R_hat_j + eps (uniform in place of the first term while R_hat is 0).
- `epsilon_lag: 1`: it updates after step t with eps_t, so step t + 1 is drawn with mixing rate
  eps_t (not eps_{t+1}) and temperature eps_{t-1} (1/K at the first update).
- `warmup_steps` W and `initial_weights`: its runs draw the first W steps (2000 in its scripts)
  from fixed initial weights (the Pile's own mixture; here `tokens`, the natural one) and update
  nothing during them; the step counter t keeps counting, and the bandit's first policy uses
  the temperature eps_0 = 1/K.
- `estimator: cumulative` with `reward_scale: 0.1`: `Exp3WeightUpdater`, plain EXP3 (a sum of
  importance-weighted rewards, each scaled by 1/10).
- `draw_unit: batch`: its single-domain loop (Algorithm 1's one pull per step): the whole global
  batch comes from one domain drawn from pi_t with a generator seeded by (seed, step).
Its mixed mini-batches draw a domain per micro-batch and average the micro-batches' mean losses;
here a domain is drawn per sequence and its loss is the mean over its tokens. It can also update
every n-th step only (`data_sampling_update_frequency`, 1 in its scripts): not offered.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from data.sampling.weights import check_weights
from doremi.methods.log import MethodLog
from doremi.methods.odm.config import ESTIMATORS, POLICIES, REWARDS, ODMConfig
from trainer.run.hooks import MethodBase, MethodContext, Needs, StepSignals

#: Tag of the generator that picks the step's domain under `draw_unit: batch` (apart from the
#: sampler's streams).
ARM_DRAWS = 0x0D31


def exploration_rate(t: int, k: int) -> float:
    """eps_t = min(1/K, sqrt(ln K / (K t))) (Algorithm 1, line 2); eps_t = 1/K for t <= 0
    (its initialisation eps_0 = 1/K)."""
    if t <= 0:
        return 1.0 / k
    return min(1.0 / k, math.sqrt(math.log(k) / (k * t)))


def exp3_policy(rewards: np.ndarray, eps: float, temperature: float, policy: str = "softmax") -> np.ndarray:
    """pi = (1 - K eps) g + eps (Algorithm 1, line 3), g = softmax(temperature * R_hat) (the
    paper's Gibbs policy) or, `policy="linear"`, R_hat / sum(R_hat) (the authors' mixed-batch
    update; uniform while R_hat sums to 0). float64 [K]."""
    r = np.asarray(rewards, dtype=np.float64)
    k = len(r)
    if policy == "softmax":
        z = temperature * r
        e = np.exp(z - z.max())
        g = e / e.sum()
    elif policy == "linear":
        total = r.sum()
        g = r / total if total > 0 else np.full(k, 1.0 / k)
    else:
        raise ValueError(f"policy: expected one of {', '.join(POLICIES)}, got {policy!r}")
    return (1.0 - k * eps) * g + eps


def step_rewards(
    domain_loss: np.ndarray,
    probs: np.ndarray,
    reward: str = "loss",
    importance_weighting: bool = True,
    scale: float = 1.0,
) -> np.ndarray:
    """This step's reward of each domain: scale * L_i / pi_t(i) (Algorithm 1, line 5's
    importance-weighted loss), with exp(L_i) for `reward="exp_loss"` and without the division
    when `importance_weighting` is false. Meaningful only for the domains drawn this step."""
    if reward not in REWARDS:
        raise ValueError(f"reward: expected one of {', '.join(REWARDS)}, got {reward!r}")
    loss = np.asarray(domain_loss, dtype=np.float64)
    r = scale * (np.exp(loss) if reward == "exp_loss" else loss)
    if not importance_weighting:
        return r
    p = np.asarray(probs, dtype=np.float64)
    return np.divide(r, p, out=np.zeros_like(r), where=p > 0)


def update_rewards(
    estimate: np.ndarray, rewards: np.ndarray, drawn: np.ndarray, smoothing: float, estimator: str = "smoothed"
) -> np.ndarray:
    """R_hat_i <- alpha R_hat_i + (1 - alpha) r_i (Algorithm 1, line 5) or, `estimator="cumulative"`,
    R_hat_i + r_i (plain EXP3), for the domains with `drawn[i]`; the others keep R_hat_i."""
    old = np.asarray(estimate, dtype=np.float64)
    r = np.asarray(rewards, dtype=np.float64)
    if estimator == "smoothed":
        new = smoothing * old + (1.0 - smoothing) * r
    elif estimator == "cumulative":
        new = old + r
    else:
        raise ValueError(f"estimator: expected one of {', '.join(ESTIMATORS)}, got {estimator!r}")
    return np.where(np.asarray(drawn, dtype=bool), new, old)


class ODM(MethodBase):
    """Owns R_hat (host float64 [K]); the policy pi_t is a function of t and R_hat."""

    def __init__(self, cfg: ODMConfig, ctx: MethodContext):
        self.cfg = cfg
        self.domains = ctx.domains
        self.k = ctx.k
        self.seed = ctx.seed
        self.needs = Needs(draws="random", host_signals=True)
        if cfg.initial_weights == "tokens":
            self.initial = check_weights(ctx.train_tokens, ctx.domains, "mixing.odm.initial_weights (train tokens)")
        else:
            self.initial = np.full(self.k, 1.0 / self.k)
        self.estimate = np.zeros(self.k, dtype=np.float64)
        self.log = MethodLog(ctx)

    @property
    def first_bandit_step(self) -> int:
        """The first step drawn from the bandit's policy (the earlier ones: `initial`)."""
        return self.cfg.warmup_steps + 1 + self.cfg.epsilon_lag

    def epsilons(self, step: int) -> tuple[float, float]:
        """(mixing rate, temperature) of step `step`'s policy: eps_{t - lag} and eps_{t - 1 - lag},
        the latter eps_0 = 1/K at the bandit's first step."""
        s = step - self.cfg.epsilon_lag
        temperature = exploration_rate(s - 1, self.k) if step > self.first_bandit_step else 1.0 / self.k
        return exploration_rate(s, self.k), temperature

    def policy(self, step: int) -> np.ndarray:
        """pi_t from the current R_hat (that of steps < t when called before step t's update)."""
        if step < self.first_bandit_step:
            return self.initial.copy()
        eps, temperature = self.epsilons(step)
        return exp3_policy(self.estimate, eps, temperature, self.cfg.policy)

    def sampling_weights(self, step: int) -> np.ndarray:
        pi = self.policy(step)
        if self.cfg.draw_unit == "sequence":
            return pi
        arm = int(np.random.default_rng([self.seed, ARM_DRAWS, step]).choice(self.k, p=pi / pi.sum()))
        one_hot = np.zeros(self.k, dtype=np.float64)
        one_hot[arm] = 1.0
        return one_hot

    def drawn_probabilities(self, step: int, signals: StepSignals) -> np.ndarray:
        """pi_t(i) as the step realised it, what a reward is divided by: per-sequence draws come
        from `signals.weights`, the policy less what the run's epoch caps moved
        (data/sampling/sampler.py; the policy itself while no cap binds); a whole-batch draw
        pulled its arm with the policy's probability."""
        if self.cfg.draw_unit == "sequence":
            return np.asarray(signals.weights, dtype=np.float64)
        return self.policy(step)

    def after_step(self, step: int, signals: StepSignals) -> dict[str, Any]:
        pi = self.drawn_probabilities(step, signals)
        host = signals.on_host()
        loss = host.domain_loss
        tokens = host.tokens.tolist()
        if step > self.cfg.warmup_steps:
            drawn = np.asarray(tokens) > 0
            r = step_rewards(loss, pi, self.cfg.reward, self.cfg.importance_weighting, self.cfg.reward_scale)
            self.estimate = update_rewards(self.estimate, r, drawn, self.cfg.smoothing, self.cfg.estimator)
        nxt = self.policy(step + 1).tolist()
        estimate = self.estimate.tolist()
        self.log.append(
            step,
            {
                "weights": nxt,
                "tokens": tokens,
                "sampling": pi.tolist(),
                "sequences": [int(n) for n in signals.sequences],
                "loss": loss.tolist(),
                "reward": estimate,
            },
        )
        row: dict[str, Any] = {
            "domain_weights": dict(zip(self.domains, nxt)),
            "odm_reward": dict(zip(self.domains, estimate)),
        }
        if step + 1 >= self.first_bandit_step:
            row["odm_exploration"] = self.epsilons(step + 1)[0]
        return row

    def state_dict(self) -> dict[str, Any]:
        return {"estimate": self.estimate.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.estimate = np.asarray(state["estimate"], dtype=np.float64)

    def close(self) -> None:
        self.log.close()
