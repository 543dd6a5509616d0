"""Data mixing laws' nested pipeline (Ye et al., ICLR 2025, Sec. 4 and Fig. 1; released code
github yegcjs/mixinglaws at commit 8ad3e1244b53294ded55a96ae325f4112ce3bc63, `pipeline/run.sh`):
the proxies' losses are extrapolated in training tokens, then in model size, and only then is the
mixing law (`fit.py`) fitted and minimised.

1. Step law (`pipeline/steplaw.py`, run.sh L5): per proxy size and mixture, the validation
   domains' losses along the run, from `step_from` of its last evaluation on (the authors fit
   steps 10k-30k, `--fit_step_range 10000,30000`), fitted by c_i + (D0_i / D)^alpha in training
   tokens D with alpha shared by the domains (`--tie_alpha valid`), and evaluated at the main
   run's tokens (`sizelaw.py` L35, L58: `power_law(step * BSZ, steplaw)`).
2. Size law (`pipeline/sizelaw.py`, run.sh L8): across the proxy sizes, those extrapolated losses
   fitted by c + (N0 / N)^alpha in model size N, alpha shared by every mixture and domain
   (`--tie_alpha all`), and evaluated at the main model's size. The law has two parameters per
   curve and a shared exponent, so it needs at least `MIN_SIZES` proxy sizes. With fewer (a
   sweep trains one model size) it is not fitted: the mixing law is then fitted to the losses at
   the largest proxy's size and the main run's tokens, and the result says so (`Extrapolation.size`).
3. The mixing law (`fit.py`) fitted to the extrapolated losses, per domain, by the Huber
   loss with delta 0.05 (`mix_5_domains.ipynb`, the `law.fit(..., delta=0.05)` of the "fit with
   mixture law" cell), and minimised.

Each law is checked on what it did not see: the step law predicting each curve's last
`step_holdout` evaluations (the authors' `valid_split=5`, steplaw.py L128), the size law
predicting the largest proxy (`valid_split=1`, sizelaw.py L63) when at least `MIN_SIZES + 1`
sizes leave three to fit, the mixing law by held-out mixtures (`doremi.offline.fit.evaluate.held_out`, in the caller).

Differences from the released pipeline, named: (a) `pipeline/mixlaw.py` fits an AdaBoost
ensemble of exp-activated MLPs (`MixtureMLP`, `pipeline/utils.py` L144-176) to the target loss;
here the paper's Eq. 2 law per domain is fitted, as in the released notebooks, because it is
the law the paper states and its minimiser is exact (`fit.py`); (b) `pipeline/find_opt.py`
searches a grid of the simplex, here a convex solve; (c) the optimiser of the power laws
(`power_law.py`); (d) the model size N is `trainer.model.flops.non_embedding_params` (blocks,
final norm and LM head), the authors' `MODEL_SIZES` count Pythia's without the LM head: a fixed
definition across sizes is what the shared-exponent law needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from doremi.methods.mixing_law.power_law import SIZE_DELTA, STEP_DELTA, fit_power_law, held_out_tail
from doremi.offline.fit.checks import FitError

#: The size law's parameters (2 per curve, 1 shared) need this many proxy sizes.
MIN_SIZES = 3
#: Points per curve the step law needs on top of those its check holds out.
MIN_STEP_POINTS = 3


@dataclass(frozen=True)
class ProxyCurves:
    """One proxy size's sweep: `params` (its model size N), `tokens` [p] (training tokens at each
    evaluation, increasing), `losses` [n runs, p, m validation domains]."""

    params: float
    tokens: np.ndarray
    losses: np.ndarray


@dataclass(frozen=True)
class NestedOptions:
    """`step_from`: the step law fits the evaluations from this fraction of the last one's
    tokens on; `step_holdout`: evaluations per curve its check holds out; the Huber deltas."""

    step_from: float = 0.3
    step_holdout: int = 2
    step_delta: float = STEP_DELTA
    size_delta: float = SIZE_DELTA


@dataclass(frozen=True)
class Extrapolation:
    """The losses [n, m] the mixing law is fitted to, and what each law did: `step` (per proxy
    size: its fit and held-out check), `size` (its fit and check, or why it was not fitted)."""

    losses: np.ndarray
    step: list[dict[str, Any]] = field(default_factory=list)
    size: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"step_law": self.step, "size_law": self.size}


def _check_proxy(p: ProxyCurves) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.asarray(p.tokens, dtype=np.float64)
    losses = np.asarray(p.losses, dtype=np.float64)
    if losses.ndim != 3 or tokens.shape != (losses.shape[1],):
        raise FitError(f"step law: expected tokens [p] and losses [n, p, m], got {tokens.shape} and {losses.shape}")
    if not (np.all(np.diff(tokens) > 0) and tokens[0] > 0):
        raise FitError(f"step law: expected increasing positive tokens, got {tokens.tolist()}")
    if not (np.all(np.isfinite(losses)) and np.all(losses > 0)):
        raise FitError("step law: expected finite positive losses")
    if not (np.isfinite(p.params) and p.params > 0):
        raise FitError(f"size law: expected a positive model size, got {p.params}")
    return tokens, losses


def step_extrapolate(
    proxy: ProxyCurves, target_tokens: float, options: NestedOptions | None = None
) -> tuple[np.ndarray, dict[str, Any]]:
    """Each run's per-domain losses at `target_tokens` [n, m] by its step law, and the record of
    the fit: points used, exponents, residuals, the held-out check of the last evaluations."""
    o = options or NestedOptions()
    tokens, losses = _check_proxy(proxy)
    keep = tokens >= o.step_from * tokens[-1]
    x, y = tokens[keep], losses[:, keep, :]
    if x.size < MIN_STEP_POINTS:
        raise FitError(
            f"step law: {x.size} evaluation(s) per run from {o.step_from:g} of the run on; expected at least "
            f"{MIN_STEP_POINTS}: evaluate more often (sweep.eval_points), "
            "or fit the final losses (fit.mixing_law.variant: direct)"
        )
    laws = [fit_power_law(x, y[i], o.step_delta) for i in range(y.shape[0])]
    out = np.stack([law.predict(np.array([float(target_tokens)]))[0] for law in laws])
    record: dict[str, Any] = {
        "params": float(proxy.params),
        "points": int(x.size),
        "tokens": [float(x[0]), float(x[-1])],
        "target_tokens": float(target_tokens),
        "alpha": [law.alpha for law in laws],
        "rmse_max": float(max(law.rmse.max() for law in laws)),
        "laws": [law.to_dict() for law in laws],
    }
    if x.size - o.step_holdout >= MIN_STEP_POINTS and o.step_holdout >= 1:
        checks = [held_out_tail(x, y[i], o.step_holdout, o.step_delta) for i in range(y.shape[0])]
        record["held_out"] = {
            "held": o.step_holdout,
            "fitted_on": int(x.size - o.step_holdout),
            "mae": float(np.mean([c.mae for c in checks])),
            "max_abs": float(max(c.max_abs for c in checks)),
        }
    else:
        record["held_out_skipped"] = (
            f"{x.size} points per curve leave fewer than {MIN_STEP_POINTS} to fit after holding out {o.step_holdout}"
        )
    return out, record


def extrapolate(
    proxies: Sequence[ProxyCurves],
    target_tokens: float,
    target_params: float,
    options: NestedOptions | None = None,
) -> Extrapolation:
    """The nested pipeline's steps 1 and 2 (the module's docstring): every proxy's runs to the
    main run's tokens by their step laws, then to the main model's size by the size law (when
    there are at least `MIN_SIZES` proxy sizes; else the largest proxy's losses, said so)."""
    o = options or NestedOptions()
    if not proxies:
        raise FitError("nested fit: expected at least one proxy size")
    if not (np.isfinite(target_tokens) and target_tokens > 0 and np.isfinite(target_params) and target_params > 0):
        raise FitError(f"nested fit: expected positive target tokens and size, got {target_tokens}, {target_params}")
    order = sorted(range(len(proxies)), key=lambda i: proxies[i].params)
    sizes = [float(proxies[i].params) for i in order]
    if len(set(sizes)) != len(sizes):
        raise FitError(f"size law: expected distinct proxy sizes, got {sizes}")
    steps = [step_extrapolate(proxies[i], target_tokens, o) for i in order]
    at_tokens = np.stack([s[0] for s in steps])
    if len({a.shape for a in at_tokens}) != 1:
        raise FitError("size law: expected the same runs and domains at every proxy size")
    n, m = at_tokens.shape[1:]
    if len(sizes) < MIN_SIZES:
        size: dict[str, Any] = {
            "skipped": (
                f"{len(sizes)} proxy size(s) (N = {', '.join(f'{s:.4g}' for s in sizes)}); the size law needs at "
                f"least {MIN_SIZES}: the mixing law is fitted to the losses at N = {sizes[-1]:.4g}, "
                f"not at the main model's N = {float(target_params):.4g}"
            ),
            "sizes": sizes,
            "target_params": float(target_params),
        }
        return Extrapolation(losses=at_tokens[-1], step=[s[1] for s in steps], size=size)
    x = np.asarray(sizes)
    y = at_tokens.reshape(len(sizes), n * m)
    law = fit_power_law(x, y, o.size_delta)
    losses = law.predict(np.array([float(target_params)]))[0].reshape(n, m)
    size = {
        "sizes": sizes,
        "target_params": float(target_params),
        "alpha": law.alpha,
        "rmse_max": float(law.rmse.max()),
        "law": law.to_dict(),
    }
    if len(sizes) >= MIN_SIZES + 1:
        size["held_out"] = held_out_tail(x, y, 1, o.size_delta).to_dict()
    else:
        size["held_out_skipped"] = f"{len(sizes)} sizes: holding out the largest leaves fewer than {MIN_SIZES}"
    return Extrapolation(losses=losses, step=[s[1] for s in steps], size=size)
