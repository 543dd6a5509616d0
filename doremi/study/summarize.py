"""`doremi study summarize ARCHIVE_OR_DIR --out DIR`: every number of the study recomputed from
the raw logs (issue 34; docs/design.md section 4e).

The input is a directory of run directories or a .tar.xz / .tar.gz / .tar of them (the
archive a study commits). Per arm of the design: its runs paired by seed with the baseline's
(a seed whose partner is missing or unfinished is left out and named), the verdict row
(doremi/study/verdict.py), its compute per seed (doremi/reports/ledger.py: its search stages and its
main run) and the guardrails the rule gates on (the reference's memorisation gap beyond its own
SE; epochs read). Writes study.md, study.json and study.png.
"""

from __future__ import annotations

import json
import tarfile
import tempfile
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from data.atomic import atomic_write_text
from doremi.reports.outputs import WRITTEN_BY, check_outputs, md_mark, png_metadata
from doremi.study.design import DESIGN, Design
from doremi.study.runs import StudyError, Withheld, find_run_dirs, pair_runs, read_run, seeds_for, withheld
from doremi.study.sharing import shares_of
from doremi.study.verdict import ArmResult, SequenceLosses, arm_result, baseline_result, verdict_line

STUDY_MD, STUDY_JSON, STUDY_PNG = "study.md", "study.json", "study.png"
COMMAND = "doremi study summarize"
#: Columns of the verdict table (`arms_table` without `more`).
ARM_COLUMNS = 13
ARCHIVES = (".tar.xz", ".tar.gz", ".tgz", ".tar")


def unpack(archive: Path, into: Path) -> Path:
    """Extract a tar archive of run directories (tarfile's `data` filter: no absolute paths,
    links out of the tree or devices)."""
    try:
        with tarfile.open(archive) as tf:
            tf.extractall(into, filter="data")
    except (tarfile.TarError, EOFError) as e:
        why = " ".join(str(e).split())  # tarfile lists each method it tried on a line of its own
        raise StudyError(f"{archive}: not a readable tar archive ({why})") from None
    return into


def read_sequences(run: Path, step: int) -> SequenceLosses | None:
    """The run's per-sequence losses at its final evaluation `step`, where it logged them
    (`train.eval_sequence_losses`: eval_sequences/step_NNNNNNN.npz, whose columns
    trainer/records/eval_sequences.py documents): per domain, (mean loss of each sequence, the document
    id of its first label token, the cluster). None when the file is absent."""
    path = run / "eval_sequences" / f"step_{step:07d}.npz"
    if not path.is_file():
        return None
    with np.load(path, allow_pickle=False) as z:
        need = {"domain", "loss_sum", "tokens", "doc_first", "domains"}
        if not need <= set(z.files):
            raise StudyError(f"{path}: expected the columns {', '.join(sorted(need))}")
        domain, docs = z["domain"], z["doc_first"]
        mean = z["loss_sum"].astype(np.float64) / np.maximum(z["tokens"].astype(np.float64), 1.0)
        return {str(d): (mean[domain == i], docs[domain == i]) for i, d in enumerate(z["domains"].tolist())}


def compute_of(
    dirs: Mapping[tuple[str, int], Path],
    arm: str,
    stages: tuple[str, ...],
    seeds: tuple[int, ...],
    kinds: Mapping[str, str] | None = None,
    extra: Mapping[int, Mapping[str, Mapping[str, Any]]] | None = None,
    pooled_from: Sequence[int] | None = None,
    shares: Mapping[str, float] | None = None,
):
    """Per seed the arm's ledger (its search stages and its main run), and the mean over seeds
    of the summed parts (None where a seed's part is unknown). `kinds`: a stage's ledger kind
    where it is not its name (the comparison's `odm_proxy` is a `method` run); `extra`: per
    seed, stages costed elsewhere (a sweep, which is no run directory) added to the sums;
    `pooled_from`: the seeds whose searches a pooled arm's mixture averages, all of them
    charged to each of its seeds (`<stage>-seed<k>` in its stages); `shares`: run name -> the
    fraction of the GPU it had (doremi/study/sharing.py), which scales its GPU-seconds."""
    from doremi.reports.ledger import arm_ledger, sum_costs

    per_seed, missing = {}, []
    search = [(st, k) for k in pooled_from or () for st in stages if (st, k) in dirs]
    missing += [f"{st}-seed{k}" for k in pooled_from or () for st in stages if (st, k) not in dirs]
    shared = arm_ledger([((kinds or {}).get(st, st), dirs[(st, k)]) for st, k in search], shares, by_run=True)
    for s in seeds:
        own = () if pooled_from is not None else stages
        runs = [((kinds or {}).get(st, st), dirs[(st, s)]) for st in own if (st, s) in dirs]
        missing += [f"{st}-seed{s}" for st in own if (st, s) not in dirs]
        per_seed[s] = arm_ledger([*runs, ("main", dirs[(arm, s)])], shares)
        added = {**shared["stages"], **((extra or {}).get(s) or {})}
        if added:
            per_seed[s]["stages"].update(added)
            per_seed[s]["missing"] += shared["missing"]
            per_seed[s]["sum"] = sum_costs(list(per_seed[s]["stages"].values()))
    sums = [c["sum"] for c in per_seed.values()]
    keys = sums[0].keys() if sums else ()
    mean = {k: (sum(x[k] for x in sums) / len(sums) if all(x[k] is not None for x in sums) else None) for k in keys}
    return {"per_seed_mean": mean, "per_seed": per_seed, "missing": missing}


def guardrail_findings(
    dirs: Mapping[tuple[str, int], Path], design: Design, main_runs: Collection[str] | None = None
) -> list[str]:
    """The rule's guardrails over every run: the reference's memorisation gap beyond its own SE
    (doremi/reports/guardrails.py) and the epochs read, at the design's thresholds; one line each.
    `main_runs`: the names of main runs (default: the design's arms)."""
    return [f.message for _, f in guardrail_warnings(dirs, design, main_runs)]


def guardrail_warnings(
    dirs: Mapping[tuple[str, int], Path], design: Design, main_runs: Collection[str] | None = None
) -> list[tuple[tuple[str, int], Any]]:
    """`guardrail_findings` with the run each finding is on, (name, seed) -> its `Finding`: the
    comparison voids the arms that use that run (doremi/study/comparison/guards.py)."""
    from doremi.config import GuardrailConfig
    from doremi.reports.guardrails import check_run, warnings

    cfg = GuardrailConfig(memorisation_gap=design.guardrails.memorisation_gap, max_epochs=design.guardrails.max_epochs)
    arms = set(main_runs) if main_runs is not None else {a.name for a in design.arms}
    out = []
    for key, path in sorted(dirs.items()):
        name = key[0]
        kind = name if name in ("reference", "proxy") else "main" if name in arms else None
        if kind is None:
            continue
        checks = ("memorisation", "epochs") if kind == "reference" else ("epochs",)
        out += [(key, f) for f in warnings(check_run(path, kind, cfg, path.name)) if f.check in checks]
    return out


def summarize(root: Path, design: Design = DESIGN, gate: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every arm's result against the baseline, the notes, the guardrails; a JSON-able dict
    (with the ArmResult objects under `results`). `gate`: the calibration's decision
    (calibration.json's `decision`). Under a gate that said go, every arm is judged on the
    pre-registered seeds, 1 to the gate's pairs, and nothing else: an arm lacking one of those
    pairs is withheld (`withheld`: no verdict, what it lacks), and runs of later seeds are named
    and left out. Without a gate, every arm on the seeds it has."""
    dirs = find_run_dirs(root)
    arms = [a.name for a in design.arms]
    runs = {k: read_run(p) for k, p in dirs.items() if k[0] in arms}
    base = design.rule.baseline
    if not any(a == base for a, _ in runs):
        raise StudyError(f"{root}: no {base}-seed<k> run (the baseline of the rule)")
    seeds = seeds_for(int(gate["pairs"])) if gate and gate.get("go") else None
    beyond = sorted(f"{a}-seed{s}" for a, s in runs if seeds is not None and s not in seeds)
    if seeds is not None:
        runs = {k: r for k, r in runs.items() if k[1] in seeds}
    sequences = {k: read_sequences(r.path, r.final_step) for k, r in runs.items()}
    shares = shares_of(dirs.values())
    results: list[ArmResult] = []
    held: list[Withheld] = []
    for arm in design.arms:
        if arm.name == base or (seeds is None and not any(a == arm.name for a, _ in runs)):
            continue
        w = None if seeds is None else withheld(runs, arm.name, base, seeds)
        if w is not None:
            held.append(w)
            continue
        pairs = pair_runs(runs, arm.name, base, strict=False)
        pooled = pooled_seeds(dirs, arm.search_stages, seeds) if arm.pooled else None
        if pooled is not None:
            check_pooled(root, arm.name, arm.search_stages[-1], pairs.runs, pooled)
        compute = compute_of(dirs, arm.name, arm.search_stages, pairs.seeds, pooled_from=pooled, shares=shares)
        results.append(arm_result(pairs, design, sequences, compute))
    bases = sorted((r for (a, _), r in runs.items() if a == base and not r.unfinished), key=lambda r: r.seed)
    if not bases:
        raise StudyError(f"{root}: every {base} run is unfinished")
    first = bases[0]
    baseline = baseline_result(bases, compute_of(dirs, base, (), tuple(r.seed for r in bases), shares=shares))
    return {
        "results": [baseline, *results],
        "primary": design.primary,
        "guardrails": guardrail_findings(dirs, design),
        "split": first.split,
        "domains": list(first.domains),
        "unfinished": sorted(r.describe_unfinished() for r in runs.values() if r.unfinished),
        "gate": gate_notes(gate) + beyond_note(beyond, seeds),
        "withheld": held,
    }


def pooled_seeds(
    dirs: Mapping[tuple[str, int], Path], stages: Sequence[str], seeds: Sequence[int] | None
) -> tuple[int, ...]:
    """The seeds whose searches a pooled arm averages: the gate's pre-registered seeds, or
    without a gate every seed with a run of its last search stage."""
    if seeds is not None:
        return tuple(seeds)
    return tuple(sorted({k for (name, k) in dirs if stages and name == stages[-1]}))


def check_pooled(
    root: Path,
    arm: str,
    stage: str,
    runs: Sequence[Any],
    seeds: Sequence[int],
    file: str = "weights.json",
    kind: str = "run",
) -> None:
    """Refuse a pooled arm whose main runs did not all train on one weights file, or whose file
    (a `file` found under root by its content) was not made from the `stage` sources (of
    `kind`: runs averaged, or sweeps fitted, as the comparison's swept arms pool) of exactly
    `seeds`: the mixture the arm's verdict is about is then not the one it pre-registered."""
    from data import artifact
    from trainer.records.run_dir import RECORD_FILE, content_id

    read = {}
    for r in runs:
        record = r.path / RECORD_FILE
        try:
            keys = json.loads(record.read_text()).get("keys", {}) if record.is_file() else {}
        except (ValueError, AttributeError):
            raise StudyError(f"{record}: damaged, not a run record (valid JSON object)") from None
        read[r.name] = keys.get("data.domain_weights (content)")
    if None in read.values() or len(set(read.values())) != 1:
        seen = ", ".join(f"{n} {c}" for n, c in sorted(read.items()))
        raise StudyError(f"{arm}: a pooled arm trains every seed on one weights file, but its runs read {seen}")
    want = next(iter(read.values()))
    found = [p for p in sorted(root.rglob(file)) if content_id(str(p)) == want]
    if not found:
        raise StudyError(f"{arm}: the weights file its runs trained on (content {want}) is not under {root}")
    header = artifact.read(found[0])
    made_from = sorted(Path(src.path).name for src in (header.sources if header else ()) if src.kind == kind)
    expect = sorted(f"{stage}-seed{k}" for k in seeds)
    if made_from != expect:
        raise StudyError(
            f"{arm}: its weights {found[0].relative_to(root)} pool {', '.join(made_from) or 'no recorded runs'}; "
            f"the design pools {', '.join(expect)}"
        )


def beyond_note(beyond: Sequence[str], seeds: Sequence[int] | None) -> list[str]:
    """The runs of seeds past the gate's pairs, named once: a study judges the pairs it
    pre-registered, not the ones it happened to add."""
    return [f"{', '.join(beyond)}: beyond the gate's {len(seeds or ())} pairs, not judged"] if beyond else []


def gate_notes(gate: Mapping[str, Any] | None) -> list[str]:
    """The calibration's refusal, when its gate refused the study (an arm short of the pairs
    it decided is withheld, `Withheld`)."""
    if gate is None or gate.get("go"):
        return []
    return [f"the calibration's gate refused the study: {gate.get('line', 'NO-GO')}"]


def _f(x: float | None, digits: int = 4, sign: bool = False) -> str:
    return "" if x is None else f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def _pm(m: float | None, se: float | None, sign: bool = True) -> str:
    return _f(m, sign=sign) + ("" if se is None else f" ± {se:.4f}")


def _arm_row(r: Any) -> list[str]:
    """One arm's row of the verdict table."""
    p, t, c = r.paired, r.tost, r.compute.get("per_seed_mean", {})
    wd = r.worst_domain
    flops, secs = c.get("train_flops_total"), c.get("gpu_seconds")
    return [
        r.arm,
        str(len(r.seeds)),
        _pm(r.mean_loss, r.mean_loss_se, sign=False),
        "" if p is None else _pm(p.mean, p.se),
        "" if p is None else f"[{p.ci[0]:+.4f}, {p.ci[1]:+.4f}]",
        r.verdict,
        "" if t is None else f"{t.decision} (p {t.p:.3f})",
        "" if r.worst_case is None else _pm(*r.worst_case),
        "" if wd is None else f"{wd.domain} {_pm(wd.mean, wd.se)}",
        ""
        if not r.domains
        else f"{r.better}/{len(r.domains)} ({r.beyond(-1)} beyond 2 SE; {r.beyond(+1)} worse beyond 2 SE; "
        f"{r.domains[0].se_kind} SE)",
        "" if flops is None else f"{flops / 1e15:.1f} PFLOP",
        "" if secs is None else f"{secs:.0f}",
        "" if r.se_ok is None else ("yes" if r.se_ok else "**no**"),
    ]


def arms_table(
    summary: dict[str, Any],
    design: Design,
    extra: Sequence[list[str]] = (),
    baseline: str | None = None,
    more: Sequence[str] = (),
    cells: Sequence[Sequence[str]] = (),
) -> str:
    """The verdict table: one row per arm, against the rule's baseline (or `baseline`, named so
    in the header). `extra`: rows after the arms' (the comparison's withheld arms); `more`:
    columns after the study's, with each arm's `cells` in them."""
    from doremi.reports.report import markdown_table

    rule = design.rule
    rows = [_arm_row(r) + list(x) for r, x in zip(summary["results"], cells or [()] * len(summary["results"]))]
    return markdown_table(
        [
            "arm",
            "pairs",
            f"mean {summary['split']} loss ± SE",
            f"minus {baseline or rule.baseline} ± SE",
            f"{rule.ci_level:.0%} CI",
            "verdict",
            f"TOST ±{rule.margin:g}",
            "worst case (max over domains) minus baseline",
            "worst domain (largest difference)",
            "domains better",
            "compute per seed (search + main; the monitoring evaluations apart)",
            "GPU-s per seed (training steps)",
            f"SE <= {rule.max_se:g}",
            *more,
        ],
        rows + [list(r) for r in extra],
    )


def domain_table(summary: dict[str, Any], design: Design) -> str:
    """Per domain, each arm's difference from the baseline (mean over seeds ± SE)."""
    from doremi.reports.report import markdown_table

    rule, results = design.rule, summary["results"]
    domains = summary["domains"]
    dom_rows = [
        [d] + [_pm(r.domains[i].mean, r.domains[i].se) for r in results if r.domains] for i, d in enumerate(domains)
    ]
    return markdown_table(["domain", *[f"{r.arm} - {rule.baseline}" for r in results if r.domains]], dom_rows)


def seed_table(summary: dict[str, Any], design: Design) -> str:
    """Per seed, each paired arm's difference from the baseline: the values whose spread is
    sigma_D, so a reader sees which seeds carry an arm's SE."""
    from doremi.reports.report import markdown_table

    paired = [r for r in summary["results"] if r.diffs]
    if not paired:
        return "No arm is paired with the baseline (every arm is withheld, below).\n"
    seeds = sorted({s for r in paired for s in r.seeds})
    by_arm = [dict(zip(r.seeds, r.diffs)) for r in paired]
    rows = [[f"seed {s}"] + [f"{d[s]:+.4f}" if s in d else "" for d in by_arm] for s in seeds]
    return markdown_table(["seed", *[f"{r.arm} - {design.rule.baseline}" for r in paired]], rows)


def guard_text(guards: list[Any], design: Design) -> str:
    """That every guardrail of the rule holds, or the ones that failed."""
    return (
        "Every guardrail of the rule holds (memorisation gap - "
        f"{design.guardrails.se_multiple:g} SE <= {design.guardrails.memorisation_gap:g}; epochs <= "
        f"{design.guardrails.max_epochs:g})."
        if not guards
        else "**The study does not count: a guardrail of the rule failed.**\n\n" + "\n".join(f"- {g}" for g in guards)
    )


def _note_text(summary: dict[str, Any]) -> str:
    """The arms' notes, the unfinished runs, the gate, and missing stages, each once."""
    results = summary["results"]
    notes = [n for r in results for n in r.notes] + summary["unfinished"] + summary["gate"]
    notes += [w.line() for w in summary.get("withheld", ())]
    for r in results:
        notes += [
            f"{r.arm}: no run directory {m}; its compute leaves that stage out" for m in r.compute.get("missing", [])
        ]
    return "\n".join(f"- {n}" for n in dict.fromkeys(notes)) or "- none"


def primary_line(results: list[Any], design: Design) -> str:
    """The design's primary difference and whether its SE is within the rule's `max_se`."""
    r = next((r for r in results if r.arm == design.primary), None)
    if r is None or r.paired is None:
        return f"**Primary difference** ({design.primary} - {design.rule.baseline}): not judged (no pairs)"
    ok = "within" if r.se_ok else "**above**"
    return (
        f"**Primary difference** ({design.primary} - {design.rule.baseline}): {r.paired.mean:+.4f} nats, "
        f"SE {r.paired.se:.4f}, {ok} the rule's {design.rule.max_se:g}."
    )


def _verdict_lines(results: list[Any], design: Design, guards: list[Any]) -> str:
    """One verdict line per paired arm, headed by a warning if a guardrail failed."""
    lines = "\n".join(f"- {verdict_line(r, design)}" for r in results if r.paired is not None)
    if guards:
        lines = "**The study does not count: a guardrail of the rule failed (below).** By the numbers:\n\n" + lines
    return lines


def format_markdown(summary: dict[str, Any], design: Design = DESIGN, source: str = "") -> str:
    rule, results = design.rule, summary["results"]
    table = arms_table(summary, design, extra=[w.row(ARM_COLUMNS) for w in summary.get("withheld", ())])
    dom_table = domain_table(summary, design)
    guards = summary["guardrails"]
    guards_md = guard_text(guards, design)
    note_text = _note_text(summary)
    lines = _verdict_lines(results, design, guards)
    return f"""# The DoReMi study: {", ".join(r.arm for r in results)}

Written by `doremi study summarize{(" " + source) if source else ""}` from the raw logs; the rule is
doremi/study/design.py's, fixed before the runs. Endpoint: mean {summary["split"]} loss over domains
at the final step (nats/token); differences are arm minus {rule.baseline}, paired by seed (negative:
the arm is better). Verdict: "works" if the mean < -t_(0.95,n-1) x SE, "worse" if > +t_(0.95,n-1) x SE.

## Verdict

{primary_line(results, design)}

{lines}

{table}
## Guardrails

{guards_md}

## Per seed

{seed_table(summary, design)}
## Per domain (mean over seeds ± SE)

{dom_table}
![study](study.png)

## Notes

{note_text}
"""


def to_json(summary: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in summary.items() if k not in ("results", "withheld")}
    if "withheld" in summary:
        out["withheld"] = [asdict(w) for w in summary["withheld"]]
    out["results"] = []
    for r in summary["results"]:
        d = asdict(r)
        d["worst_domain"] = None if r.worst_domain is None else asdict(r.worst_domain)
        d["domains_better"] = r.better
        if d["void"] is None:
            del d["void"]  # study.json as before: the study voids as a whole (guard_text)
        out["results"].append(d)
    return out


def plot(path: Path, summary: dict[str, Any], design: Design = DESIGN) -> None:
    """Left: each arm's paired difference with its CI; right: the per-domain differences ± SE."""
    from matplotlib.figure import Figure

    from doremi.reports.report import _save

    results = [r for r in summary["results"] if r.paired is not None]
    if not results:  # still written: an earlier run's plot beside this run's table would disagree with it
        fig = Figure(figsize=(6, 2), layout="constrained")
        held = ", ".join(w.arm for w in summary.get("withheld", ())) or "none"
        fig.text(0.5, 0.5, f"no arm judged (withheld: {held})", ha="center", va="center")
        _save(fig, path, png_metadata(COMMAND))
        return
    domains = summary["domains"]
    fig = Figure(figsize=(12, 4), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[1, 3])
    for i, r in enumerate(results):
        p = r.paired
        left.errorbar([i], [p.mean], yerr=[[p.mean - p.ci[0]], [p.ci[1] - p.mean]], fmt="o", capsize=4)
        width = 0.8 / len(results)
        x = [j + (i - (len(results) - 1) / 2) * width for j in range(len(domains))]
        right.errorbar(
            x,
            [d.mean for d in r.domains],
            yerr=[d.se or 0.0 for d in r.domains],
            fmt="o",
            ms=3,
            capsize=2,
            label=r.arm,
        )
    for ax in (left, right):
        ax.axhline(0, color="k", lw=0.8)
        ax.grid(axis="y", alpha=0.3)
    rule = design.rule
    left.axhspan(-rule.margin, rule.margin, color="tab:green", alpha=0.12, label=f"±{rule.margin:g} (TOST)")
    left.set_xticks(range(len(results)), [r.arm for r in results])
    left.set(ylabel=f"minus {rule.baseline}, mean loss (nats)", title=f"{rule.ci_level:.0%} CI, paired by seed")
    left.legend(fontsize=8)
    right.set_xticks(range(len(domains)), domains, rotation=30)
    right.set(ylabel="per-domain difference (nats)", title="per domain, mean ± SE over seeds")
    right.legend(fontsize=8)
    _save(fig, path, png_metadata(COMMAND))


def check_source(source: Path) -> None:
    """Refuse a source that is neither a directory nor an archive `unpack` reads."""
    if not source.exists():
        raise StudyError(f"{source}: not found")
    if source.is_file() and not source.name.endswith(ARCHIVES):
        raise StudyError(f"{source}: expected a directory or a {', '.join(ARCHIVES)} archive")


def read_gate(calibration: str | Path | None) -> dict[str, Any] | None:
    """The calibration's decision (calibration.json's `decision`), None without a calibration."""
    if calibration is None:
        return None
    try:
        return json.loads(Path(calibration).read_text())["decision"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise StudyError(f"{calibration}: not a calibration.json ({e})") from None


def run_summary(
    source: str | Path, out: str | Path, design: Design = DESIGN, calibration: str | Path | None = None
) -> dict[str, Any]:
    """Recompute the study from `source` (directory or archive) into `out`: study.md,
    study.json, study.png. Prints the verdict lines. `calibration`: its calibration.json,
    whose gate decided the pairs the study needs."""
    source, out = Path(source), Path(out)
    if not source.exists():
        raise StudyError(f"{source}: not found")
    gate = read_gate(calibration)
    check_source(source)
    check_outputs(out, (STUDY_JSON, STUDY_MD, STUDY_PNG), COMMAND)
    with tempfile.TemporaryDirectory(prefix="doremi-study-") as tmp:
        root = unpack(source, Path(tmp)) if source.is_file() else source
        summary = summarize(root, design, gate)
        out.mkdir(parents=True, exist_ok=True)
        text = md_mark(COMMAND) + format_markdown(summary, design, str(source))
        doc = {WRITTEN_BY: COMMAND, **to_json(summary)}
        atomic_write_text(out / STUDY_JSON, json.dumps(doc, indent=1, default=str) + "\n")
        plot(out / STUDY_PNG, summary, design)
        atomic_write_text(out / STUDY_MD, text)
    for r in summary["results"]:
        if r.paired is not None:
            print(verdict_line(r, design))
    for w in summary["withheld"]:
        print(w.line())
    print(f"written: {out / STUDY_MD}, {out / STUDY_JSON}, {out / STUDY_PNG}")
    return summary
