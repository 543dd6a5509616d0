"""Guardrails: per-domain checks that a run's regime supports a verdict (docs/design.md section 4b).

A mixture comparison is meaningless when the reference memorised its tiny domains (its excess
loss then measures the proxy's memory gap, not learnability), when the sampler did not draw what
the weights said, when the proxy is so far behind its reference that lambda measures its lag, or
when the main runs overfit. None of this makes a run fail; each check turns it into a `Finding`.

Two layers: `measure_*` functions (pure, over parsed rows) give per-domain numbers, which the
report's guardrail table shows; `findings` compares them with `GuardrailConfig`'s thresholds.
`check_run` reads a run directory and does both.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np

from data.sampling.pools import pool_size
from doremi.config import GuardrailConfig
from doremi.errors import DoReMiError
from doremi.methods import registry
from doremi.outputs.main_runs import REFERENCE_RUN, search_dirs

#: reference and proxy: DoReMi's; method: another method's proxy; sweep: a small run of the
#: offline methods' sweep (the checks of any run: epochs and, when logged, realised mixture).
Kind = Literal["reference", "proxy", "method", "sweep", "main"]
KINDS: tuple[str, ...] = ("reference", "proxy", "method", "sweep", "main")
#: Random draws: the realised mixture is compared with the nominal beyond this many standard errors.
RANDOM_DRAW_SIGMAS = 3.0
#: The memorisation gap warns only when gap - this many standard errors > memorisation_gap
#: (issue 34: at 512 held-back sequences a 0.05-nat limit is about one standard deviation of
#: the gap's own noise, so a plain comparison warned on noise most of the time).
MEMORISATION_SES = 2.0
#: A weight above this is "concentrated": one domain gets most of the proxy's loss.
CONCENTRATED = 0.5
#: Below this many epochs of a domain a sequence was trained on about once: a held-out minus
#: seen gap there is what one pass teaches, not the repetition the memorisation check is about.
MEMORISATION_MIN_EPOCHS = 0.5

#: Per check: what a warning means for the result, and what to change (a key and a value).
ADVICE: dict[str, tuple[str, str]] = {
    "epochs": (
        "a domain read this often can be memorised, so its validation loss flatters the mixture that repeats it",
        "more data for the domain, fewer train.steps, or cap the mixture with data.max_epochs: 2",
    ),
    "mixture": (
        "the run did not train on the mixture it reports, so its result belongs to another mixture",
        "a larger train.global_batch_size (more draws per step), or pipeline.guardrails.mixture_tolerance",
    ),
    "memorisation": (
        "the reference has memorised its training sequences, so its losses (and DoReMi's excess losses) are too low",
        "train the reference on more data or for fewer train.steps; data.holdout_sequences: 512 for a tighter check",
    ),
    "proxy_lag": (
        "the proxy is far behind its reference, so its excess losses measure its lag more than each domain's headroom",
        f"train the proxy as long as its reference (the same train.steps), or a lower mixing.{REFERENCE_RUN}.eta",
    ),
    "lambda_snr": (
        "the domain weights follow batch noise, so their average is close to the proxy's sampling mixture",
        "a larger train.global_batch_size or more train.steps for the proxy",
    ),
    "concentration": (
        "one domain takes most of the weight for many steps; its averaged weight may be an artefact of eta",
        f"a lower mixing.{REFERENCE_RUN}.eta or a larger mixing.{REFERENCE_RUN}.smoothing",
    ),
    "overfit": (
        "the run got worse after its best evaluation, so its final loss understates the mixture",
        "fewer train.steps or more data",
    ),
}

Rows = Sequence[Mapping[str, Any]]
PerDomain = dict[str, float]


@dataclass(frozen=True)
class Finding:
    """One check's verdict on one domain (or on the whole run when `domain` is None)."""

    run: str
    check: str
    domain: str | None
    value: float | None
    threshold: float | None
    message: str
    level: Literal["warning", "info"] = "warning"
    #: For a warning: what it means for the result and what to change (ADVICE).
    advice: str | None = None

    @property
    def is_warning(self) -> bool:
        return self.level == "warning"


class GuardrailError(DoReMiError):
    """Warnings under `pipeline.strict`: one line per finding."""

    def __init__(self, findings: Sequence[Finding]):
        self.findings = list(findings)
        super().__init__("\n".join(f.message for f in self.findings))


# -- measures: pure functions over parsed rows ---------------------------------------------


def eval_rows(rows: Rows) -> list[Mapping[str, Any]]:
    return [r for r in rows if isinstance(r.get("val_loss"), dict)]


def epochs_read(rows: Rows) -> PerDomain:
    """Epochs of each domain's train split read by the run (its last row that says)."""
    last = [r["epochs"] for r in rows if isinstance(r.get("epochs"), dict)]
    return {d: float(v) for d, v in last[-1].items()} if last else {}


def mixture_deviation(rows: Rows, global_batch_size: int) -> PerDomain:
    """Realised minus nominal share of the sequences drawn since step 1, per domain:
    (realised_sequences - nominal_sequences) / (steps * B), from the last row with `realised`.

    A run that draws at random (`realised.draws` is `random`: a bandit's true draws) deviates by
    sampling noise alone; its deviation is counted only beyond RANDOM_DRAW_SIGMAS binomial
    standard errors sqrt(p (1 - p) / n) of the share, p the nominal share and n the sequences
    drawn, so that what is flagged is a sampler that does not follow its weights."""
    last = [r for r in rows if isinstance(r.get("realised"), dict)]
    if not last:
        return {}
    row = last[-1]
    total = float(row["step"] * global_batch_size)
    drawn, nominal = row["realised"]["sequences"], row["realised"]["nominal_sequences"]
    dev = {d: (float(drawn[d]) - float(nominal[d])) / total for d in nominal}
    if row["realised"].get("draws") != "random":
        return dev
    out = {}
    for d, x in dev.items():
        p = min(max(float(nominal[d]) / total, 0.0), 1.0)
        slack = RANDOM_DRAW_SIGMAS * math.sqrt(p * (1 - p) / total)
        out[d] = math.copysign(max(abs(x) - slack, 0.0), x)
    return out


def memorisation(row: Mapping[str, Any]) -> tuple[PerDomain, PerDomain] | None:
    """(memorisation gap heldout - seen, train/validation shift val - heldout) per domain at an
    evaluation; None when the run held nothing out (`data.holdout_sequences` = 0). A domain
    whose loss is missing (null: no sequence to evaluate yet) is left out."""
    seen, held = row.get("seen_loss"), row.get("heldout_loss")
    if not isinstance(seen, dict) or not isinstance(held, dict):
        return None
    val = row["val_loss"]
    known = [d for d in held if held[d] is not None]
    gap = {d: float(held[d]) - float(seen[d]) for d in known if seen.get(d) is not None}
    shift = {d: float(val[d]) - float(held[d]) for d in known if val.get(d) is not None}
    return gap, shift


def memorisation_se(row: Mapping[str, Any]) -> PerDomain:
    """Standard error of the memorisation gap per domain: sqrt(se_seen^2 + se_heldout^2), from
    the eval row's `seen_loss_se` and `heldout_loss_se` (empty when it has none)."""
    seen, held = row.get("seen_loss_se"), row.get("heldout_loss_se")
    if not isinstance(seen, dict) or not isinstance(held, dict):
        return {}
    return {
        d: math.hypot(float(seen[d]), float(held[d])) for d in held if held[d] is not None and seen.get(d) is not None
    }


def beyond_noise(value: float, se: float, threshold: float, multiple: float = MEMORISATION_SES) -> bool:
    """Whether a measured value exceeds `threshold` by more than `multiple` of its standard
    error: value - multiple x se > threshold (issue 34, ../shared/study-design.md: a guardrail
    gates only beyond its own noise; at 2 SE a true value at the threshold warns about 2.3% of
    the time, a one-sided normal test)."""
    return value - multiple * se > threshold


def difference(a: Mapping[str, float], b: Mapping[str, float]) -> PerDomain:
    """a - b over the domains both have (e.g. proxy minus reference final validation loss)."""
    return {d: float(a[d]) - float(b[d]) for d in a if d in b}


def final_minus_best(rows: Rows) -> PerDomain:
    """Final minus lowest validation loss over the run's evaluations, per domain."""
    evals = eval_rows(rows)
    if not evals:
        return {}
    final = evals[-1]["val_loss"]
    return {d: float(final[d]) - min(float(r["val_loss"][d]) for r in evals if d in r["val_loss"]) for d in final}


def reference_on_batches(history: Rows) -> PerDomain:
    """The reference's mean loss per token on the proxy's batches (token-weighted over steps).

    Those are training sequences the reference has read too, so their loss far below its
    validation loss is memorisation, measurable without a holdout."""
    if not history:
        return {}
    domains = history[0]["domains"]
    out = {}
    for i, d in enumerate(domains):
        tokens = sum(int(h["tokens"][i]) for h in history)
        if tokens:
            out[d] = sum(float(h["ref_loss"][i]) * int(h["tokens"][i]) for h in history) / tokens
    return out


def lambda_snr(excess: Sequence[Sequence[float]]) -> float | None:
    """Signal-to-noise of lambda: std across domains of each domain's mean lambda over the
    run, over the mean of the domains' per-step noise.

    A domain's noise is sqrt(mean((lambda_t - lambda_{t-1})^2) / 2), the standard deviation of
    one step's lambda estimated from successive differences, so that lambda's slow drift while
    the proxy learns does not count as noise. Below 1, alpha_t follows the noise of single
    batches more than the differences between domains. None with < 2 steps or < 2 domains, or
    when lambda neither moves nor differs."""
    x = np.asarray(excess, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2 or x.shape[1] < 2:
        return None
    noise = float(np.sqrt((np.diff(x, axis=0) ** 2).mean(axis=0) / 2).mean())
    spread = float(x.mean(axis=0).std())
    if noise == 0:
        return math.inf if spread > 0 else None
    return spread / noise


def run_level_snr(per_step: float | None, steps: int) -> float | None:
    """The per-step signal-to-noise times sqrt(steps). alpha_T is exp(eta x the sum of lambda_t):
    the domains' differences add up linearly in the steps, the batch noise as its square root,
    so a per-step ratio well below 1 still gives weights set by the signal over a long run."""
    if per_step is None or steps < 1:
        return None
    return per_step * math.sqrt(steps)


def concentration(weights: Sequence[Sequence[float]], domains: Sequence[str]) -> tuple[float, str | None]:
    """(share of steps where some weight > 0.5, the domain above 0.5 most often)."""
    if not weights:
        return 0.0, None
    over = np.asarray(weights, dtype=np.float64) > CONCENTRATED
    counts = over.sum(axis=0)
    share = float(over.any(axis=1).mean())
    return share, (domains[int(counts.argmax())] if counts.max() > 0 else None)


# -- the measures of one run, and the findings they give ----------------------------------


@dataclass
class RunMeasures:
    """Everything the checks and the guardrail table need from one run."""

    run: str
    kind: str
    global_batch_size: int | None = None
    epochs: PerDomain = field(default_factory=dict)
    mixture: PerDomain = field(default_factory=dict)
    gap: PerDomain = field(default_factory=dict)
    # Standard error of each gap (the two means' errors in quadrature), when the run logged them.
    gap_se: PerDomain = field(default_factory=dict)
    shift: PerDomain = field(default_factory=dict)
    lag: PerDomain = field(default_factory=dict)
    ref_batches_gap: PerDomain = field(default_factory=dict)
    # True: ref_batches_gap is held-out minus proxy-batch loss (memorisation alone); False:
    # validation minus proxy-batch loss (memorisation plus any train/validation shift).
    ref_batches_heldout: bool = False
    final_minus_best: PerDomain = field(default_factory=dict)
    snr: float | None = None
    steps: int = 0
    concentration: float | None = None
    concentrated_domain: str | None = None
    notes: list[str] = field(default_factory=list)
    # The run's own values of the keys its advice names (config.yaml), so that a warning says
    # which value to set instead of which way to move (`advice`).
    settings: dict[str, float] = field(default_factory=dict)


def measure(
    run: str,
    kind: str,
    rows: Rows,
    global_batch_size: int | None = None,
    history: Rows | None = None,
    reference_rows: Rows | None = None,
) -> RunMeasures:
    """The measures of a run of `kind` from its parsed metrics rows (and, for a proxy, its
    domain_weights.jsonl records and its reference's metrics rows)."""
    if kind not in KINDS:
        raise DoReMiError(f"guardrails: run kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    m = RunMeasures(run, kind, global_batch_size, epochs=epochs_read(rows))
    if not m.epochs:
        m.notes.append(f"{run}: no epochs logged; epochs check skipped")
    if global_batch_size and any(isinstance(r.get("realised"), dict) for r in rows):
        m.mixture = mixture_deviation(rows, global_batch_size)
    else:
        m.notes.append(f"{run}: no realised mixture logged; realised-vs-nominal check skipped")
    evals = eval_rows(rows)
    if kind == "reference":
        mem = memorisation(evals[-1]) if evals else None
        if mem is None:
            why = "data.holdout_sequences = 0" if evals else "no evaluation logged: the run did not reach its end"
            m.notes.append(f"{run}: no held-out evaluation ({why}); memorisation check skipped")
        else:
            m.gap, m.shift = mem
            m.gap_se = memorisation_se(evals[-1])
    if kind == "proxy":
        ref_evals = eval_rows(reference_rows or [])
        if evals and ref_evals:
            m.lag = difference(evals[-1]["val_loss"], ref_evals[-1]["val_loss"])
            held = ref_evals[-1].get("heldout_loss")
            m.ref_batches_heldout = isinstance(held, dict)
            base = (
                {d: v for d, v in held.items() if v is not None} if m.ref_batches_heldout else ref_evals[-1]["val_loss"]
            )
            m.ref_batches_gap = difference(base, reference_on_batches(history or []))
        else:
            m.notes.append(f"{run}: no validation loss of the proxy or of its reference; proxy-lag check skipped")
        if history and all("excess" in h for h in history):
            m.snr = lambda_snr([h["excess"] for h in history])
            m.steps = len(history)
            m.concentration, m.concentrated_domain = concentration(
                [h["weights"] for h in history], history[0]["domains"]
            )
        else:
            m.notes.append(f"{run}: no domain_weights.jsonl; lambda and concentration checks skipped")
    if kind == "main":
        m.final_minus_best = final_minus_best(rows)
    return m


def _over(
    m: RunMeasures,
    check: str,
    values: PerDomain,
    threshold: float,
    what: str,
    key: str,
    unit: str = "",
    absolute: bool = False,
) -> list[Finding]:
    """A warning per domain whose value (or its magnitude) is above `threshold`."""
    out = []
    for d, v in values.items():
        shown = abs(v) if absolute else v
        if shown > threshold:
            out.append(
                Finding(
                    m.run,
                    check,
                    d,
                    v,
                    threshold,
                    f"{m.run}: {d}: {what} {shown:.4g}{unit} > {key} {threshold:.4g}{unit}",
                )
            )
    return out


def findings(m: RunMeasures, cfg: GuardrailConfig) -> list[Finding]:
    """The warnings (thresholds crossed) and infos (checks skipped, train/validation shift) of a
    run's measures. Keys in the messages are those of `pipeline.guardrails`."""
    out: list[Finding] = [Finding(m.run, "skipped", None, None, None, note, "info") for note in m.notes]
    out += _over(m, "epochs", m.epochs, cfg.max_epochs, "epochs read", "max_epochs")
    out += _mixture(m, cfg)
    out += _memorisation(m, cfg)
    out += _shift(m)
    out += _reference_gap(m, cfg)
    out += _over(
        m, "proxy_lag", m.lag, cfg.proxy_lag, "proxy minus reference final validation loss", "proxy_lag", " nats"
    )
    out += _lambda_snr(m, cfg)
    out += _concentration(m, cfg)
    out += _over(m, "overfit", m.final_minus_best, cfg.overfit, "final minus best validation loss", "overfit", " nats")
    return [replace(f, advice=advice(f.check, m.settings)) if f.is_warning else f for f in out]


def _mixture(m: RunMeasures, cfg: GuardrailConfig) -> list[Finding]:
    """Realised against nominal mixture; the default tolerance is one sequence per batch."""
    if not (m.mixture and m.global_batch_size):
        return []
    tol = cfg.mixture_tolerance if cfg.mixture_tolerance is not None else 1 / m.global_batch_size
    return _over(
        m, "mixture", m.mixture, tol, "|realised - nominal| share of sequences", "mixture_tolerance", absolute=True
    )


def _memorisation(m: RunMeasures, cfg: GuardrailConfig) -> list[Finding]:
    """Heldout minus seen loss per domain, with its standard error where known: an info, not a
    warning, when the domain was read too few epochs to judge or the gap is within noise."""
    found: list[Finding] = []
    for f in _over(
        m,
        "memorisation",
        m.gap,
        cfg.memorisation_gap,
        "memorisation gap (heldout - seen loss)",
        "memorisation_gap",
        " nats",
    ):
        se = m.gap_se.get(f.domain or "")
        if se is None:
            found.append(f)
            continue
        f = replace(f, message=f.message.replace(" nats >", f" ± {se:.2g} nats (standard error) >", 1))
        read = m.epochs.get(f.domain or "")
        if read is not None and read < MEMORISATION_MIN_EPOCHS:
            f = replace(
                f,
                level="info",
                message=f"{f.message}: cannot be judged at this scale (the domain was read {read:.2g} epochs, "
                f"below {MEMORISATION_MIN_EPOCHS:g}: a sequence seen about once, not repeated); not a warning",
            )
        elif not beyond_noise(float(f.value or 0.0), se, cfg.memorisation_gap):
            f = replace(
                f,
                level="info",
                message=f"{f.message}, within {MEMORISATION_SES:g} standard errors: not a warning",
            )
        found.append(f)
    return found


def _shift(m: RunMeasures) -> list[Finding]:
    """Validation minus heldout loss per domain: an info on how far validation is from train."""
    return [
        Finding(
            m.run,
            "shift",
            d,
            v,
            None,
            f"{m.run}: {d}: train/validation shift (val - heldout loss) {v:.4g} nats",
            "info",
        )
        for d, v in m.shift.items()
    ]


def _reference_gap(m: RunMeasures, cfg: GuardrailConfig) -> list[Finding]:
    """The reference's memorisation of the proxy's batches (held-out or, failing that,
    validation loss minus its loss on those batches)."""
    return _over(
        m,
        "memorisation",
        m.ref_batches_gap,
        cfg.memorisation_gap,
        "reference held-out loss minus its loss on the proxy's batches"
        if m.ref_batches_heldout
        else "reference validation loss minus its loss on the proxy's batches (includes any train/validation "
        "shift: no held-out sequences)",
        "memorisation_gap",
        " nats",
    )


def _lambda_snr(m: RunMeasures, cfg: GuardrailConfig) -> list[Finding]:
    """The online weights' signal-to-noise over the whole run, below which alpha follows noise."""
    run_snr = run_level_snr(m.snr, m.steps)
    if not (run_snr is not None and run_snr < cfg.lambda_snr):
        return []
    return [
        Finding(
            m.run,
            "lambda_snr",
            None,
            run_snr,
            cfg.lambda_snr,
            f"{m.run}: lambda signal-to-noise over the run {run_snr:.4g} (per step {m.snr:.4g}, "
            f"{m.steps} steps) < lambda_snr {cfg.lambda_snr:.4g} (alpha follows batch noise)",
        )
    ]


def _concentration(m: RunMeasures, cfg: GuardrailConfig) -> list[Finding]:
    """The share of steps one domain's weight stays above CONCENTRATED."""
    if not (m.concentration is not None and m.concentration > cfg.concentration):
        return []
    return [
        Finding(
            m.run,
            "concentration",
            m.concentrated_domain,
            m.concentration,
            cfg.concentration,
            f"{m.run}: {m.concentrated_domain}: share of steps with a weight above "
            f"{CONCENTRATED} {m.concentration:.4g} > concentration {cfg.concentration:.4g}",
        )
    ]


def advice(check: str, settings: Mapping[str, float] | None = None) -> str | None:
    """`means: ...; change: ...` for a check's warning (ADVICE), the change with values where the
    run's `settings` (RunMeasures.settings) give them (`specific_change`)."""
    if check not in ADVICE:
        return None
    means, change = ADVICE[check]
    return f"means: {means}; change: {specific_change(check, settings or {}) or change}"


def specific_change(check: str, settings: Mapping[str, float]) -> str | None:
    """A proxy's change as keys and values from its own config: its reference's train.steps
    when it trained fewer, else half its eta (and ten times its smoothing for concentration);
    None where the config does not give them (the generic advice stands)."""
    eta = settings.get(f"mixing.{REFERENCE_RUN}.eta")
    smoothing = settings.get(f"mixing.{REFERENCE_RUN}.smoothing")
    lower_eta = f"mixing.{REFERENCE_RUN}.eta: {eta / 2:g} (now {eta:g})" if eta else None
    if check == "proxy_lag":
        steps, ref_steps = settings.get("train.steps"), settings.get("reference train.steps")
        if steps and ref_steps and steps < ref_steps:
            longer = f"train.steps: {ref_steps:g} for the proxy, as its reference trained (now {steps:g})"
            return f"{longer}, or {lower_eta}" if lower_eta else longer
        if lower_eta and steps and steps == ref_steps:
            return f"{lower_eta}; the proxy already trains as long as its reference"
        return lower_eta
    if check == "concentration" and lower_eta:
        return (
            f"{lower_eta}, or mixing.{REFERENCE_RUN}.smoothing: {smoothing * 10:g} (now {smoothing:g})"
            if smoothing
            else lower_eta
        )
    return None


def warnings(found: Iterable[Finding]) -> list[Finding]:
    return [f for f in found if f.is_warning]


def print_findings(found: Iterable[Finding], file: IO[str] | None = None, prefix: str = "doremi") -> None:
    """One line per warning and per run-level info (the per-domain shift infos go to the
    report's table only); after a check's first warning, an indented line saying what it means
    and what to change."""
    file = file or sys.stderr
    for f, advice_line in with_advice(f for f in found if f.is_warning or f.domain is None):
        print(f"{prefix}: {f.level}: {f.message}", file=file, flush=True)
        if advice_line:
            print(f"    {advice_line}", file=file, flush=True)


def with_advice(found: Iterable[Finding]) -> list[tuple[Finding, str | None]]:
    """Each finding with its advice the first time its check warns (ten domains over one
    threshold get one explanation, not ten)."""
    said: set[str] = set()
    out = []
    for f in found:
        out.append((f, f.advice if f.advice and f.check not in said else None))
        if f.advice:
            said.add(f.check)
    return out


# -- reading run directories ---------------------------------------------------------------


def run_dir_of(path: str | Path) -> Path:
    """The run directory of a run or checkpoint directory (mixing.doremi.reference takes either)."""
    p = Path(path)
    if (p / "metrics.jsonl").is_file() or (p / "config.yaml").is_file():
        return p
    return p.parent.parent if p.parent.name == "checkpoints" else p.parent


def measure_run(
    run_dir: str | Path, kind: str, name: str | None = None, reference: str | Path | None = None
) -> RunMeasures:
    """Read a run directory (metrics.jsonl, config.yaml, and for a proxy domain_weights.jsonl
    and its reference's metrics.jsonl) and measure it. `reference`: the proxy's reference run
    (default: its config's mixing.doremi.reference)."""
    from doremi.methods.history import HistoryError, read_history
    from trainer.config.tools import read_yaml
    from trainer.records.metrics import read_jsonl

    run = Path(run_dir)
    if not (run / "metrics.jsonl").is_file():
        raise DoReMiError(f"{run}/metrics.jsonl: not found (expected a run directory)")
    rows = read_jsonl(run / "metrics.jsonl")
    cfg = read_yaml(run / "config.yaml") if (run / "config.yaml").is_file() else {}
    batch = cfg.get("train", {}).get("global_batch_size")
    history: list[dict] | None = None
    ref_rows: list[dict] | None = None
    if kind == "proxy":
        try:
            history = read_history(run)
        except HistoryError:
            history = None
        own = registry.options(cfg, REFERENCE_RUN)
        settings = {f"mixing.{REFERENCE_RUN}.{k}": own[k] for k in ("eta", "smoothing") if _number(own.get(k))}
        ref = reference or own.get("reference")
        if ref:
            ref_rows = read_jsonl(run_dir_of(ref) / "metrics.jsonl")
            ref_cfg = run_dir_of(ref) / "config.yaml"
            ref_steps = read_yaml(ref_cfg).get("train", {}).get("steps") if ref_cfg.is_file() else None
            if _number(ref_steps):
                settings["reference train.steps"] = ref_steps
    m = measure(name or str(run), kind, rows, batch, history, ref_rows)
    steps = cfg.get("train", {}).get("steps")
    if kind == "proxy":
        m.settings = {**settings, **({"train.steps": steps} if _number(steps) else {})}
    return m


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_run(
    run_dir: str | Path,
    kind: str,
    cfg: GuardrailConfig | None = None,
    name: str | None = None,
    reference: str | Path | None = None,
) -> list[Finding]:
    """The findings of one run directory of `kind` (reference, proxy, method, main)."""
    return findings(measure_run(run_dir, kind, name, reference), cfg or GuardrailConfig())


def pipeline_runs(root: str | Path, main: bool = True) -> list[tuple[str, str, Path]]:
    """(name, kind, directory) of a pipeline's runs that exist: every round's reference and
    DoReMi proxy, the other methods' proxies (kind `method`: the checks of any run, epochs and
    realised mixture), then (with `main`) the main runs."""
    root = Path(root)
    runs: list[tuple[str, str, Path]] = []
    rounds = sorted(
        (p for p in root.glob("round*") if p.is_dir() and p.name[5:].isdigit()), key=lambda p: int(p.name[5:])
    )
    for r in rounds:
        for search in search_dirs(r):
            for kind in ("reference", "proxy"):
                if (search / kind / "metrics.jsonl").is_file():
                    runs.append((str((search / kind).relative_to(root)), kind, search / kind))
    for method in sorted(p for p in root.glob("methods/*") if p.is_dir()):
        for search in search_dirs(method):
            if (search / "proxy" / "metrics.jsonl").is_file():
                runs.append((str((search / "proxy").relative_to(root)), "method", search / "proxy"))
    if main and (root / "main").is_dir():
        for d in sorted(p for p in (root / "main").iterdir() if (p / "metrics.jsonl").is_file()):
            runs.append((f"main/{d.name}", "main", d))
    return runs


def measure_pipeline(root: str | Path, main: bool = True, manifest: Any = None) -> list[RunMeasures]:
    """The measures of every run of a pipeline root (a proxy compared with its own round's
    reference), then those of the offline methods' sweep (`measure_sweep`). `manifest`: the
    stores' (default: that of the store_dir a run's config.yaml names)."""
    root = Path(root)
    out = [
        measure_run(path, kind, name, path.parent / "reference" if kind == "proxy" else None)
        for name, kind, path in pipeline_runs(root, main)
    ]
    from doremi.outputs.main_runs import SWEEP_DIR

    return out + measure_sweep(root / SWEEP_DIR, manifest or _root_manifest(root))


def _root_manifest(root: Path) -> Any:
    """The manifest of the stores a pipeline root's runs read (the first config.yaml that names
    one); None when no run saved a config or the stores are gone."""
    from data.store.store import read_manifest
    from trainer.config.tools import read_yaml

    for cfg in sorted(root.glob("*/*/config.yaml")) + sorted(root.glob("methods/*/proxy/config.yaml")):
        store = read_yaml(cfg).get("data", {}).get("store_dir")
        if store:
            try:
                return read_manifest(store)
            except (DoReMiError, OSError, ValueError):
                continue
    return None


def nominal_epochs(weights: Sequence[float], sequences: int, pools: Sequence[int]) -> list[float]:
    """Epochs a run of `sequences` sequences reads of each domain under `weights` (the exact-count
    sampler draws every domain's share to within one sequence)."""
    return [float(w) * sequences / n if n else 0.0 for w, n in zip(weights, pools)]


def measure_sweep(sweep: Path, manifest: Any) -> list[RunMeasures]:
    """One measure per run of a finished sweep (`sweep.json`, `mixtures.csv`): the epochs it
    read of each domain. Runs trained one by one (`runs/<i>/metrics.jsonl`) are measured from
    what they logged; stacked runs log no draws, so their epochs are the mixture's (steps x
    batch x weight / the domain's pool), as the guardrail table says. None before the sweep ran."""
    import csv
    import json

    meta = sweep / "sweep.json"
    if not meta.is_file() or not (sweep / "mixtures.csv").is_file():
        return []
    keys = json.loads(meta.read_text()).get("keys", {})
    finished = set(json.loads(meta.read_text()).get("finished", []))
    rows = list(csv.DictReader((sweep / "mixtures.csv").read_text().splitlines()))
    out: list[RunMeasures] = []
    for row in rows:
        i, name = int(row["run"]), f"sweep/run {row['run']}"
        if finished and i not in finished:
            continue
        logged = sweep / "runs" / row["run"]
        if (logged / "metrics.jsonl").is_file():
            out.append(measure_run(logged, "sweep", name))
            continue
        if manifest is None:
            missing = RunMeasures("sweep", "sweep", keys.get("train.global_batch_size"))
            missing.notes.append("sweep: the stores' manifest was not found; its runs' epochs check skipped")
            return [*out, missing]
        m = RunMeasures(name, "sweep", keys.get("train.global_batch_size"))
        domains = [d.name for d in manifest.domains]
        seq_len, holdout = int(keys["data.seq_len"]), int(keys["data.holdout_sequences"])
        pools = [pool_size(d.train.tokens, seq_len, holdout, d.name) for d in manifest.domains]
        sequences = int(keys["train.steps"]) * int(keys["train.global_batch_size"])
        m.epochs = dict(zip(domains, nominal_epochs([float(row[d]) for d in domains], sequences, pools)))
        out.append(m)
    return out


# -- the report's guardrail table ------------------------------------------------------------

#: (RunMeasures attribute, row label) in the order the table shows them.
COLUMNS = (
    ("epochs", "epochs"),
    ("mixture", "realised - nominal"),
    ("gap", "memorisation gap"),
    ("gap_se", "memorisation gap, standard error"),
    ("shift", "shift"),
    ("ref_batches_gap", "ref val - ref on proxy batches"),
    ("lag", "proxy lag"),
    ("final_minus_best", "final - best"),
)


def format_guardrail_table(domains: Sequence[str], measures: Sequence[RunMeasures]) -> str:
    """A column per domain, a row per (measure, run) that has values; then one line per proxy
    with its lambda signal-to-noise and weight concentration. (Rows are checks, not domains, so
    that the report's only rows named by a domain are those of its loss table.)"""
    from doremi.reports.report import fmt, markdown_table

    runs = [m for m in measures if m.kind != "sweep"]
    sweep = [m for m in measures if m.kind == "sweep" and m.epochs]
    rows = [
        [f"{label}: {m.run}"] + [fmt(getattr(m, attr).get(d)) for d in domains]
        for attr, label in COLUMNS
        for m in runs
        if getattr(m, attr)
    ]
    if sweep:
        rows.append(
            [f"epochs, most over the sweep's {len(sweep)} runs: sweep"]
            + [fmt(max(m.epochs.get(d, 0.0) for m in sweep)) for d in domains]
        )
    note = (
        "\nsweep: its stacked runs log no draws; their epochs are their mixtures' (weight x steps x batch "
        "/ the domain's training sequences).\n"
        if any(m.kind == "sweep" and not (m.mixture) for m in sweep)
        else ""
    )
    text = markdown_table(["check: run", *domains], rows) if rows else ""
    for m in measures:
        if m.kind == "proxy" and (m.snr is not None or m.concentration is not None):
            run_snr = run_level_snr(m.snr, m.steps)
            snr = (
                "n/a"
                if m.snr is None or run_snr is None
                else f"{m.snr:.4g} per step, {run_snr:.4g} over {m.steps} steps"
            )
            conc = "n/a" if m.concentration is None else f"{m.concentration:.4g}"
            text += (
                f"\n{m.run}: lambda signal-to-noise {snr}; share of steps with a weight above {CONCENTRATED}: {conc}\n"
            )
    return text + note
