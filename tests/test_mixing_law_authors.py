"""Data mixing laws as their authors run them (doremi/offline/fit/power_law.py, nested.py; issue 35).

Released code: github yegcjs/mixinglaws at commit 8ad3e1244b53294ded55a96ae325f4112ce3bc63. The
hand-computed cases below follow its equations, cited by file and line; the synthetic ones draw
losses from known step, size and mixing laws at once:

    L_i(r, N, D) = law_i(r) + B_i (N^-aN - N*^-aN) + G_i(r) (D^-aD - D*^-aD)

which is, for each (N, r), a step law in D with one exponent aD over the domains; at D = D*, a
size law in N with one exponent aN over every mixture and domain; and at (N*, D*) exactly the
mixing law law_i(r). G_i(r) depends on the mixture, so the proxies' own final losses are not
that law (the `direct` fit proposes another mixture).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from doremi.methods.mixing_law.fit import MixingLawOptions, canonical, fit_mixing_law, propose_mixing_law
from doremi.methods.mixing_law.nested import NestedOptions, ProxyCurves, extrapolate, step_extrapolate
from doremi.methods.mixing_law.power_law import fit_power_law, held_out_tail, huber_loss, power_law
from doremi.offline.fit import FitError
from doremi.offline.propose import fit_quality

LAW = canonical([1.5, 2.0, 1.0], [0.8, 0.6, 1.0], [[-1.0, 0.5, 0.3], [0.4, -1.2, 0.2], [0.3, 0.3, -0.9]])
A_N, A_D = 0.4, 0.6
B = np.array([30.0, 40.0, 20.0])
G = np.array([3e4, 5e4, 4e4])
N_MAIN, D_MAIN = 4e8, 2e9
SIZES = [1e6, 3e6, 1e7, 3e7]
TOKENS = np.linspace(1e7, 1e8, 8)
MIXTURES = np.random.default_rng(0).dirichlet(np.ones(3), size=8)


def truth(n: float, d: np.ndarray, r: np.ndarray = MIXTURES) -> np.ndarray:
    """[n runs, p evaluations, 3 domains] from the laws in the module's docstring."""
    amp = G * (1.0 + 2.0 * r)  # G_i(r): the step law's amplitude depends on the mixture
    return (
        LAW.domain_losses(r)[:, None, :]
        + B * (n**-A_N - N_MAIN**-A_N)
        + amp[:, None, :] * (d[None, :, None] ** -A_D - D_MAIN**-A_D)
    )


def proxies(sizes=SIZES) -> list[ProxyCurves]:
    return [ProxyCurves(params=n, tokens=TOKENS, losses=truth(n, TOKENS)) for n in sizes]


# -- the released equations, by hand ---------------------------------------------------------------


def test_power_law_is_the_released_share_alpha_form():
    """`pipeline/utils.py` L104-108 `power_law_share_alpha_`: exp(log_c) + exp(alpha (log_k -
    log x)), log_c and log_k per curve, alpha shared. With c = (2, 3), k = (1e6, 4e6), alpha 0.5:
    at x = 4e6, 2 + (1/4)^0.5 = 2.5 and 3 + 1^0.5 = 4; at x = 1.6e7, 2 + (1/16)^0.5 = 2.25 and
    3 + (1/4)^0.5 = 3.5."""
    got = power_law([4e6, 1.6e7], np.log([2.0, 3.0]), np.log([1e6, 4e6]), 0.5)
    np.testing.assert_allclose(got, [[2.5, 4.0], [2.25, 3.5]], rtol=0, atol=1e-12)


def test_mixture_law_is_the_released_form():
    """`pipeline/utils.py` L111-113 `mixture_law_`: exp(log_c) + exp(log_k + x . t). With c = 1.5,
    k = 0.5, t = (ln 2, 0, -ln 2): r = (1, 0, 0) gives 1.5 + 0.5 x 2 = 2.5, r = (0, 0, 1) gives
    1.5 + 0.5 / 2 = 1.75, r = (1/2, 0, 1/2) gives 1.5 + 0.5 = 2."""
    law = canonical([1.5], [0.5], [[math.log(2), 0.0, -math.log(2)]])
    got = law.domain_losses(np.array([[1.0, 0, 0], [0, 0, 1.0], [0.5, 0, 0.5]]))[:, 0]
    np.testing.assert_allclose(got, [2.5, 1.75, 2.0], rtol=0, atol=1e-12)


def test_huber_objective_is_the_released_one():
    """`law.py` L39: `torch.nn.functional.huber_loss(y, prediction, delta, reduction="sum")`. With
    delta 0.05 and residuals (0.01, -0.1, 0.05): 0.5 x 0.01^2 + 0.05 (0.1 - 0.025) + 0.5 x 0.05^2
    = 0.00005 + 0.00375 + 0.00125 = 0.00505."""
    import torch

    r = [0.01, -0.1, 0.05]
    assert huber_loss(r, 0.05) == pytest.approx(0.00505, abs=1e-15)
    ref = torch.nn.functional.huber_loss(
        torch.tensor(r, dtype=torch.float64), torch.zeros(3, dtype=torch.float64), delta=0.05, reduction="sum"
    )
    assert huber_loss(r, 0.05) == pytest.approx(float(ref), abs=1e-15)


def test_step_law_recovers_the_released_parameters_at_the_authors_scale():
    """Two domains of one mixture along the authors' fit range (`run.sh` L5: steps 10000-30000
    every 2500, tokens = step x BSZ, BSZ = 4096 x 256, `utils.py` L76), from log_c = (ln 2.1,
    ln 3.4), log_D0 = (20, 21), alpha 0.7 (inside the authors' start grid, `steplaw.py` L20-24)."""
    tokens = 4096 * 256 * np.arange(10000, 30001, 2500, dtype=np.float64)
    log_c, log_d0 = np.log([2.1, 3.4]), np.array([20.0, 21.0])
    y = power_law(tokens, log_c, log_d0, 0.7)
    law = fit_power_law(tokens, y)
    np.testing.assert_allclose(law.log_c, log_c, rtol=0, atol=1e-7)
    np.testing.assert_allclose(law.log_x0, log_d0, rtol=0, atol=1e-6)
    assert law.alpha == pytest.approx(0.7, abs=1e-8)
    check = held_out_tail(tokens, y, 5)  # the authors' valid_split=5 (steplaw.py L128)
    assert (check.held, check.fitted_on) == (5, 4) and check.max_abs < 1e-9


def test_the_huber_fit_shrugs_off_an_outlier():
    """The Huber loss (delta 0.05) weighs a residual beyond delta linearly: one evaluation 0.5 off
    moves the fitted curve far less than least squares would."""
    tokens = np.linspace(1e7, 1e8, 9)
    y = power_law(tokens, np.log([2.0]), np.log([3e6]), 0.5)
    y[4, 0] += 0.5
    law = fit_power_law(tokens, y)
    clean = power_law(tokens, np.log([2.0]), np.log([3e6]), 0.5)
    others = np.delete(np.arange(9), 4)
    assert np.abs(law.predict(tokens)[others] - clean[others]).max() < 0.01


# -- the nested pipeline on synthetic laws -----------------------------------------------------------


def test_nested_pipeline_recovers_the_main_runs_losses_and_optimum():
    ext = extrapolate(proxies(), D_MAIN, N_MAIN)
    target = LAW.domain_losses(MIXTURES)
    np.testing.assert_allclose(ext.losses, target, rtol=0, atol=1e-8)
    assert ext.size["alpha"] == pytest.approx(A_N, abs=1e-7)
    assert all(a == pytest.approx(A_D, abs=1e-7) for s in ext.step for a in s["alpha"])
    assert ext.size["held_out"]["held"] == 1 and ext.size["held_out"]["max_abs"] < 1e-8
    assert all(s["held_out"]["held"] == 2 and s["held_out"]["max_abs"] < 1e-8 for s in ext.step)
    fitted = fit_mixing_law(MIXTURES, ext.losses, MixingLawOptions(loss="huber", f_scale=0.05))
    best = propose_mixing_law(LAW).weights
    np.testing.assert_allclose(propose_mixing_law(fitted).weights, best, rtol=0, atol=1e-6)
    # the proxies' own final losses (the largest proxy's) propose another mixture
    direct = fit_mixing_law(MIXTURES, truth(SIZES[-1], TOKENS)[:, -1, :])
    assert np.abs(propose_mixing_law(direct).weights - best).sum() > 0.05


def test_one_proxy_size_fits_at_the_proxys_size_and_says_so():
    """A sweep trains one model size: the step law still extrapolates to the main run's tokens,
    and the size law is not fitted; the losses are the proxy size's, which the record says."""
    ext = extrapolate(proxies([3e6]), D_MAIN, N_MAIN)
    at_proxy_size = LAW.domain_losses(MIXTURES) + B * (3e6**-A_N - N_MAIN**-A_N)
    np.testing.assert_allclose(ext.losses, at_proxy_size, rtol=0, atol=1e-8)
    assert ext.size["skipped"] == (
        "1 proxy size(s) (N = 3e+06); the size law needs at least 3: the mixing law is fitted to the losses "
        "at N = 3e+06, not at the main model's N = 4e+08"
    )
    three = extrapolate(proxies(SIZES[:3]), D_MAIN, N_MAIN)
    assert "held_out" not in three.size and three.size["held_out_skipped"].startswith("3 sizes")
    np.testing.assert_allclose(three.losses, LAW.domain_losses(MIXTURES), rtol=0, atol=1e-8)


def test_step_law_check_and_refusals():
    out, record = step_extrapolate(proxies([1e6])[0], D_MAIN, NestedOptions(step_from=0.0, step_holdout=6))
    assert record["held_out_skipped"] == "8 points per curve leave fewer than 3 to fit after holding out 6"
    assert record["points"] == 8 and record["tokens"] == [1e7, 1e8]
    _, record = step_extrapolate(proxies([1e6])[0], D_MAIN, NestedOptions(step_from=0.5))
    assert record["points"] == 4  # tokens 6.1e7 .. 1e8 of 1e7 .. 1e8 (8 evenly spaced)
    short = ProxyCurves(params=1e6, tokens=TOKENS[:2], losses=truth(1e6, TOKENS[:2]))
    with pytest.raises(FitError, match=r"step law: 2 evaluation\(s\) per run .*\(sweep.eval_points\)"):
        extrapolate([short], D_MAIN, N_MAIN)
    with pytest.raises(FitError, match="distinct proxy sizes"):
        extrapolate(proxies([1e6, 1e6]), D_MAIN, N_MAIN)


# -- `doremi fit` on a sweep ----------------------------------------------------------------------------


@pytest.mark.usefixtures("one_thread")
def test_fit_records_each_law_and_its_check(stores, tmp_path, capsys):
    """A tiny sweep (6 steps, an evaluation at each): the authors' variant records the step law
    of every run with its held-out check, the size law as not fitted (one size), the mixing law's
    held-out mixtures; `direct` says it applied the proxies' final losses unchanged."""
    from doremi.commands.cli import main
    from tests.runs import config_path

    sweep = tmp_path / "sweep"
    sets = [
        "train.steps=6",
        "train.eval_sequences=4",
        "train.decay=constant",
        "train.warmup_steps=0",
        "sweep.runs=3",
        "sweep.eval_points=6",
        "sweep.designs=[dirichlet, one_hot]",
        f"sweep.run_dir={sweep}",
        "fit.folds=2",
    ]
    path = config_path(stores, tmp_path / "cfg")
    args = [a for s in sets for a in ("--set", s)]
    assert main(["sweep", str(path), *args]) == 0
    steps = sorted({int(line.split(",")[1]) for line in (sweep / "losses.csv").read_text().splitlines()[1:]})
    assert steps == [1, 2, 3, 4, 5, 6]
    assert main(["fit", str(path), "--method", "mixing_law", "--out", str(tmp_path / "a.json"), *args]) == 0
    doc = json.loads((tmp_path / "a.json").read_text())["mixing_law"]
    assert doc["variant"] == "authors" and doc["huber_delta"] == 0.05
    (step,) = doc["step_law"]
    assert step["points"] == 5 and len(step["laws"]) == 6 and step["held_out"]["fitted_on"] == 3
    assert doc["size_law"]["skipped"].startswith("1 proxy size(s)")
    assert doc["main_tokens"] == doc["proxy_tokens"]  # `doremi fit` with the sweep's own config
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("mixing law: "))
    assert (
        line.startswith("mixing law: authors (proxy N ")
        and "step law on 5 evaluations per run, held-out last 2" in line
    )
    assert line.endswith("size law not fitted: " + doc["size_law"]["skipped"])
    assert fit_quality(tmp_path / "a.json")["laws"] == line.removeprefix("mixing law: ")  # the report's line
    direct = [*args, "--set", "fit.mixing_law.variant=direct"]
    assert main(["fit", str(path), "--method", "mixing_law", "--out", str(tmp_path / "d.json"), *direct]) == 0
    doc = json.loads((tmp_path / "d.json").read_text())["mixing_law"]
    assert doc["variant"] == "direct" and "applied unchanged to the main run" in doc["fitted_to"]
