"""`doremi study compare-methods SOURCE [SOURCE ...] --out DIR`: the comparison's table, every
number recomputed from its archives (issue 39; docs/design.md section 4f).

SOURCE: directories or archives (as `doremi study summarize` reads them) of run directories: the
study's (uniform, natural, DoReMi and its reference and proxy, doremi_pooled and its `pooled/`)
and the comparison's (the launcher's stages: `<arm>-seed<k>`, `<method>_proxy-seed<k>`,
`sweep-seed<k>`, a pooled arm's `<arm>_pooled/`, `<baseline>_x<m>-seed<k>`). Every name is read from the protocol (protocol.py `Protocol`, plan.py
`arm_steps`, `EqualCompute.name`), none restated here.

Two views of cost (cost.py):

- **equal main-run tokens**: per arm, the study's row exactly (verdict.py `arm_result`: paired
  differences against uniform by seed, interval, verdict, TOST, worst domain, domains better with
  clustered SEs), and its compute from the ledger (search stages, a sweep, the main run);
- **equal total compute**: per arm and seed, the compute multiple 1 + search FLOPs / the plain
  main run's (cost.py `search_flops`, `compute_multiple`, from the ledger's `train_flops_total`),
  each baseline's per-domain losses at that multiple from its runs at the protocol's multiples
  (`baseline_at`: measured, interpolated or extrapolated, and beyond the corpus), and the same rule
  on those pairs. A seed whose multiple cannot be had (a search stage or a baseline point missing)
  withholds the arm in this view.

Every arm is judged on the same seeds, 1 to the calibration gate's pairs (or, without a
calibration, the most any arm has): an arm with fewer is listed as incomplete with what it
lacks, never judged on fewer pairs. A pooled arm (protocol.py `Arm.pooled`) is held to its one
pool (summarize.py `check_pooled`, the study's) and charged every seed's search on each seed
(`compute_of(pooled_from=...)`). Beside the rule's verdict each table gives Holm's adjustment
over the protocol's family (holm.py, `Protocol.holm_family`; a secondary arm is reported outside
it); an online arm's own pairs go through the calibration's gate (`own_gate`), since its search
is its main run and its spread was never calibrated: a NO-GO is flagged with the pairs it would
need, never given more seeds. A failing guardrail voids the arms that use its run, not the
comparison (guards.py). Writes comparison.md, comparison.json and comparison.png.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from data.atomic import atomic_write_text
from doremi.reports.outputs import WRITTEN_BY, check_outputs, md_mark, png_metadata
from doremi.study.calibration import GateDecision, decide
from doremi.study.comparison.cost import (
    EQUAL_COMPUTE,
    EQUAL_TOKENS,
    BaselineAt,
    CostError,
    Point,
    baseline_at,
    compute_multiple,
    search_flops,
)
from doremi.study.comparison.guards import Voids, guard_text, void_reasons
from doremi.study.comparison.holm import HolmReading, holm_cells, holm_readings
from doremi.study.comparison.plan import SEARCH, arm_steps, pool_file
from doremi.study.comparison.protocol import (
    ONLINE,
    PROTOCOL,
    SWEPT,
    Arm,
    Protocol,
    baseline_capacity,
    corpus_capacity,
)
from doremi.study.runs import (
    INCOMPLETE,
    RUN_NAME,
    Pairs,
    RunResult,
    StudyError,
    Withheld,
    find_run_dirs,
    pair_runs,
    read_run,
    seeds_for,
    withheld,
)
from doremi.study.sharing import shares_of
from doremi.study.summarize import (
    ARM_COLUMNS,
    arms_table,
    check_pooled,
    check_source,
    compute_of,
    domain_table,
    gate_notes,
    guardrail_warnings,
    read_gate,
    read_sequences,
    to_json,
    unpack,
)
from doremi.study.verdict import ArmResult, arm_result, baseline_result, verdict_line

COMPARISON_MD, COMPARISON_JSON, COMPARISON_PNG = "comparison.md", "comparison.json", "comparison.png"
COMMAND = "doremi study compare-methods"


@dataclass(frozen=True)
class AtCompute:
    """An arm against one baseline at the arm's total compute: per seed its multiple and how the
    baseline there was had (`BaselineAt`), and the rule's row on those pairs."""

    result: ArmResult
    baseline: str
    at: tuple[BaselineAt, ...]

    def cells(self, capacity: float) -> list[str]:
        ms = [b.multiple for b in self.at]
        multiple = f"{sum(ms) / len(ms):.3f}" + (f" ({min(ms):.3f}-{max(ms):.3f})" if max(ms) > min(ms) else "")
        flags = dict.fromkeys(
            b.flag() if b.flag().startswith(b.how) else "; ".join(filter(None, (b.how, b.flag()))) for b in self.at
        )
        if max(ms) > capacity:
            flags[f"{self.baseline}'s mixture capped at 2 epochs beyond {capacity:.2f}x"] = None
        return [multiple, "; ".join(flags)]


def search_stages(protocol: Protocol, arm: Arm) -> tuple[dict[str, str], str | None]:
    """The arm's search run directories, stage name -> ledger kind (a DoReMi-like proxy is `proxy`:
    its reference's forward is counted; another method's proxy is `method`), and its sweep's
    directory name (None without one), from the plan's steps of seed 1 (`arm_steps`)."""
    from doremi.methods import registry

    kinds, sweep = {}, None
    for step in arm_steps(protocol, arm, 1):
        if step.role != SEARCH or step.verb in ("average", "fit"):
            continue
        stage = RUN_NAME.match(step.name)["arm"]  # type: ignore[index]
        if step.verb == "sweep":
            sweep = stage
        elif step.verb == "train-reference":
            kinds[stage] = "reference"
        else:
            kinds[stage] = "proxy" if registry.spec(arm.method).needs_reference else "method"
    return kinds, sweep


def find_sources(roots: Sequence[Path]) -> tuple[dict[tuple[str, int], Path], dict[tuple[str, int], Path]]:
    """Run directories and sweep directories (`<name>-seed<k>` holding a sweep.json) under every
    root; one name twice over the roots refuses, as within one (`find_run_dirs`)."""
    runs: dict[tuple[str, int], Path] = {}
    sweeps: dict[tuple[str, int], Path] = {}
    for root in roots:
        found = find_run_dirs(root)
        found_sweeps = {}
        for meta in sorted(root.rglob("sweep.json")):
            m = RUN_NAME.match(meta.parent.name)
            if m is not None:
                found_sweeps[(m["arm"], int(m["seed"]))] = meta.parent
        for have, new in ((runs, found), (sweeps, found_sweeps)):
            for key, path in new.items():
                if key in have:
                    raise StudyError(f"two run directories for {key[0]}-seed{key[1]}: {have[key]} and {path}")
                have[key] = path
    return runs, sweeps


def check_corpus(
    runs: Mapping[tuple[str, int], RunResult], protocol: Protocol, search: Mapping[tuple[str, int], Path] | None = None
) -> None:
    """Refuse a main run whose evaluated domains, or a search run (`search`) whose configured
    domains, are not the protocol's corpus (a run of another study): a proxy on other domains
    would hand its arm a mixture of them."""
    import yaml

    want = protocol.corpus.domains
    found = {r.path: r.domains for r in runs.values()}
    for path in (search or {}).values():
        if not (path / "config.yaml").is_file():
            raise StudyError(f"{path}: no config.yaml, so its domains are unknown")
        domains = ((yaml.safe_load((path / "config.yaml").read_text()) or {}).get("data") or {}).get("domains") or []
        found[path] = tuple(d["name"] if isinstance(d, dict) else str(d) for d in domains)
    for path, domains in found.items():
        if domains != want:
            raise StudyError(
                f"{path}: domains {', '.join(domains)} are not the comparison's corpus ({', '.join(want)})"
            )


def add_search(arm: str, compute: dict[str, Any], plain: Mapping[int, float], n_search: int) -> None:
    """Per seed the arm's search FLOPs (cost.py `search_flops`: its search stages, and its main run
    beyond the plain one of that seed) into `compute` as `search_flops`, None where a search stage
    or the plain run is missing; their mean over seeds as `search_flops_mean`."""
    per_seed = {}
    for s, ledger in compute["per_seed"].items():
        stages = ledger["stages"]
        search = [c["train_flops_total"] for k, c in stages.items() if k != "main"]
        try:
            known = len(search) >= n_search and s in plain
            per_seed[s] = search_flops(search, stages["main"]["train_flops_total"], plain[s]) if known else None
        except CostError as e:
            raise StudyError(f"{arm}-seed{s}: {e}") from None
    values = list(per_seed.values())
    compute["search_flops"] = per_seed
    compute["search_flops_mean"] = sum(values) / len(values) if values and None not in values else None


def at_compute(
    protocol: Protocol,
    pairs: Pairs,
    compute: Mapping[str, Any],
    plain: Mapping[int, float],
    runs: Mapping[tuple[str, int], RunResult],
    flops: Mapping[tuple[str, int], float],
    baseline: str,
) -> AtCompute | Withheld:
    """The arm against `baseline` at the arm's total compute, seed by seed (see the module);
    `compute` holds the arm's search FLOPs per seed (`add_search`)."""
    eq, capacity = protocol.equal_compute, corpus_capacity(protocol)
    bases, at, lacks = [], [], []
    for a in pairs.runs:
        s = a.seed
        search = compute["search_flops"][s]
        if search is None:
            lacks.append(f"seed {s}: a search stage is missing, its compute is unknown")
            continue
        names = [eq.name(baseline, m) for m in eq.multiples]
        points = [Point(flops[(n, s)] / plain[s], runs[(n, s)].final) for n in names if (n, s) in flops]
        try:
            b = baseline_at(points, compute_multiple(search, plain[s]), capacity)
        except CostError as e:
            absent = [f"{n}-seed{s}" for n in names if (n, s) not in flops]
            lacks.append(
                f"seed {s}: {baseline} at the arm's compute: {e}" + (f"; no {', '.join(absent)}" if absent else "")
            )
            continue
        at.append(b)
        bases.append(replace(runs[(baseline, s)], name=f"{baseline}@{b.multiple:.3f}x-seed{s}", final=b.losses))
    if lacks:
        return Withheld(pairs.arm, len(at), len(pairs.runs), tuple(lacks))
    view = Pairs(pairs.arm, baseline, pairs.seeds, pairs.runs, tuple(bases))
    return AtCompute(arm_result(view, protocol.design, None, compute), baseline, tuple(at))


def compare(
    roots: Sequence[Path], protocol: Protocol = PROTOCOL, gate: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Both views for every arm of `protocol` from the run directories under `roots`."""
    design, eq = protocol.design, protocol.equal_compute
    base = design.rule.baseline
    dirs, sweeps = find_sources(roots)
    shares = shares_of(dirs.values())
    points = [eq.name(b, m) for b in eq.baselines for m in eq.multiples]
    runs, mains = _read_mains(protocol, roots, dirs)
    finished = [len({s for (a, s), r in runs.items() if a == arm.name and not r.unfinished}) for arm in protocol.arms]
    need = int(gate["pairs"]) if gate and gate.get("go") else max(finished)
    seeds = seeds_for(need)
    runs = {k: r for k, r in runs.items() if k[1] in seeds}
    sequences = {k: read_sequences(r.path, r.final_step) for k, r in runs.items()}
    flops = {k: _run_flops(r.path) for k, r in runs.items() if k[0] in points and not r.unfinished}
    plain = {s: flops[(base, s)] for s in seeds if (base, s) in flops}
    tokens: list[ArmResult] = []
    computed: dict[str, list[AtCompute]] = {b: [] for b in eq.baselines}
    held: dict[str, list[Withheld]] = {EQUAL_TOKENS: [], **{b: [] for b in eq.baselines}}
    for arm in protocol.arms:
        if arm.name == base:
            continue
        w = withheld(runs, arm.name, base, seeds)
        if w is not None:
            for v in held.values():
                v.append(w)
            continue
        result, at = _judge(protocol, arm, runs, dirs, sweeps, seeds, sequences, flops, plain, shares, roots)
        tokens.append(result)
        for b, got in at.items():
            (held[b] if isinstance(got, Withheld) else computed[b]).append(got)  # type: ignore[arg-type]
    bases = [r for (a, _), r in sorted(runs.items()) if a == base and not r.unfinished]
    first = bases[0] if bases else next(r for (a, _), r in runs.items() if a == base)
    base_compute = compute_of(dirs, base, (), tuple(r.seed for r in bases), shares=shares)
    add_search(base, base_compute, plain, 0)
    baseline = baseline_result(bases or [first], base_compute)
    found = guardrail_warnings(dirs, design, mains)
    voids = void_reasons(protocol, found, {a.name: _stage_names(protocol, a) for a in protocol.arms})
    tokens, computed, holm = _scoped(protocol, tokens, computed, voids)
    gates = {r.arm: g for r in tokens if (g := own_gate(protocol, r)) is not None}
    return {
        "own_gate": gates,
        "results": [baseline, *tokens],
        "at_compute": computed,
        "withheld": held,
        "pairs": need,
        "seeds": list(seeds),
        "guardrails": [f.message for _, f in found],
        "voids": voids,
        "holm": holm,
        "split": first.split,
        "domains": list(first.domains),
        "unfinished": sorted(r.describe_unfinished() for r in runs.values() if r.unfinished),
        "gate": gate_notes(gate),
        "baseline_curve": _curve(protocol, runs, flops, plain),
        "baseline_line": _line(protocol, runs, flops, plain),
    }


def _read_mains(
    protocol: Protocol, roots: Sequence[Path], dirs: Mapping[tuple[str, int], Path]
) -> tuple[dict[tuple[str, int], RunResult], list[str]]:
    """The main runs (the arms' and each baseline's at every multiple) read, and their names;
    their corpus and the search runs' checked (`check_corpus`), the rule's baseline among them."""
    eq, base = protocol.equal_compute, protocol.rule.baseline
    arms = [a.name for a in protocol.arms]
    mains = arms + [n for b in eq.baselines for m in eq.multiples if (n := eq.name(b, m)) not in arms]
    runs = {k: read_run(p) for k, p in dirs.items() if k[0] in mains}
    searched = {n for a in protocol.arms for n in _stage_names(protocol, a)} - set(mains)
    check_corpus(runs, protocol, {k: p for k, p in dirs.items() if k[0] in searched})
    if not any(a == base for a, _ in runs):
        raise StudyError(f"{', '.join(map(str, roots))}: no {base}-seed<k> run (the baseline of the rule)")
    return runs, mains


def _stage_names(protocol: Protocol, arm: Arm) -> tuple[str, ...]:
    """The arm's search run names (`search_stages`), its sweep's among them."""
    kinds, sweep = search_stages(protocol, arm)
    return (*kinds, *([sweep] if sweep else []))


def _scoped(
    protocol: Protocol, tokens: list[ArmResult], computed: dict[str, list[AtCompute]], voids: Voids
) -> tuple[list[ArmResult], dict[str, list[AtCompute]], dict[str, dict[str, HolmReading]]]:
    """Each view's rows with the arms a guardrail voids marked so (guards.py, the protocol's
    `guardrail_scope`), and each view's Holm readings over the arms the protocol judges there (holm.py)."""
    alpha = protocol.rule.alpha
    tokens = [replace(r, void=voids.get(EQUAL_TOKENS, {}).get(r.arm)) for r in tokens]
    computed = {
        b: [replace(a, result=replace(a.result, void=voids.get(b, {}).get(a.result.arm))) for a in rows]
        for b, rows in computed.items()
    }

    def over(rows: Sequence[ArmResult], baseline: str | None = None) -> dict[str, HolmReading]:
        family = protocol.holm_family(baseline)
        return holm_readings([r for r in rows if r.arm in family], alpha, len(family))

    holm = {EQUAL_TOKENS: over(tokens)}
    holm.update({b: over([a.result for a in rows], b) for b, rows in computed.items()})
    return tokens, computed, holm


def own_gate(protocol: Protocol, result: ArmResult) -> GateDecision | None:
    """An online arm's own pairs through the calibration's gate (doremi/study/calibration.py
    `decide`, as the study fed its per-seed doremi arm's pairs: calibration_doremi/, NO-GO, 42
    pairs): its search is its main run, so it cannot be pooled, and the gate's fixed-mixture
    sigma_D 0.0082 does not price it. None for other arms and fewer than 2 pairs. A NO-GO is
    reported with the pairs it would need (`power_pairs`); the arm gets no more seeds."""
    if protocol.arm(result.arm).kind != ONLINE or len(result.diffs) < 2:
        return None
    from doremi.study import stats

    return decide(stats.sigma_d(result.diffs), protocol.design.gate, protocol.rule)


def gate_cell(decision: GateDecision | None, mde: float) -> str:
    """The view-1 column of an arm's own-pairs gate: empty where the calibration's gate applies."""
    if decision is None:
        return ""
    if decision.go:
        return f"GO ({decision.pairs} pairs)"
    need = "more than 100000" if decision.power_pairs is None else str(decision.power_pairs)
    return f"**NO-GO**: needs {need} pairs for {mde:g} nats; verdict underpowered, no seeds added"


def _judge(
    protocol: Protocol,
    arm: Arm,
    runs: Mapping[tuple[str, int], RunResult],
    dirs: Mapping[tuple[str, int], Path],
    sweeps: Mapping[tuple[str, int], Path],
    seeds: Sequence[int],
    sequences: Mapping[tuple[str, int], Any],
    flops: Mapping[tuple[str, int], float],
    plain: Mapping[int, float],
    shares: Mapping[str, float],
    roots: Sequence[Path] = (),
) -> tuple[ArmResult, dict[str, AtCompute | Withheld]]:
    """One complete arm: its row at equal main tokens (the study's rule, its compute with its
    search), and per baseline its row at equal total compute (or what withholds it there).
    `shares`: each run's share of the GPU (doremi/study/sharing.py). A pooled arm is first held
    to its pool (`check_pooled`, under the root that holds its runs) and charged on every seed
    all the seeds' searches, sweeps included."""
    base = protocol.design.rule.baseline
    pairs = pair_runs(runs, arm.name, base)
    kinds, sweep = search_stages(protocol, arm)
    pooled = tuple(seeds) if arm.pooled else None
    if pooled is not None:
        stage = sweep if arm.kind == SWEPT else list(kinds)[-1]
        first = pairs.runs[0].path
        root = next((r for r in roots if r.resolve() in first.resolve().parents), first.parent)
        kind = "sweep" if arm.kind == SWEPT else "run"
        check_pooled(root, arm.name, stage, pairs.runs, pooled, pool_file(arm), kind)  # type: ignore[arg-type]
    found = {k: c for k in seeds if (c := _sweep(sweeps, sweep, k)) is not None}
    if pooled is not None:
        extra = {s: {f"{sweep}-seed{k}": c for k, c in found.items()} for s in seeds} if found else {}
    else:
        extra = {s: {"sweep": c} for s, c in found.items()}
    compute = compute_of(dirs, arm.name, tuple(kinds), tuple(seeds), kinds, extra, pooled_from=pooled, shares=shares)
    compute["missing"] += [f"{sweep}-seed{s}" for s in seeds if sweep and s not in found]
    add_search(arm.name, compute, plain, (len(kinds) + bool(sweep)) * (len(seeds) if pooled else 1))
    at = {
        b: at_compute(protocol, pairs, compute, plain, runs, flops, b)
        for b in protocol.equal_compute.baselines
        if b != arm.name
    }
    return arm_result(pairs, protocol.design, sequences, compute), at


def _run_flops(run: Path) -> float:
    from doremi.reports.ledger import study_run_cost

    cost = study_run_cost(run, "main")
    if cost is None:
        raise StudyError(f"{run}: no config.yaml, so no compute")
    return float(cost["train_flops_total"])


def _sweep(sweeps: Mapping[tuple[str, int], Path], name: str | None, seed: int) -> dict[str, Any] | None:
    from doremi.reports.ledger import sweep_stage_cost

    return None if name is None or (name, seed) not in sweeps else sweep_stage_cost(sweeps[(name, seed)])


def _curve(
    protocol: Protocol,
    runs: Mapping[tuple[str, int], RunResult],
    flops: Mapping[tuple[str, int], float],
    plain: Mapping[int, float],
) -> dict[str, list[tuple[float, float, int]]]:
    """Per baseline, (mean compute in FLOPs, mean endpoint, seeds) at each measured multiple."""
    eq, out = protocol.equal_compute, {}
    for b in eq.baselines:
        out[b] = []
        for m in eq.multiples:
            have = [(flops[k], runs[k].endpoint) for k in runs if k[0] == eq.name(b, m) and k in flops]
            if have:
                out[b].append((sum(f for f, _ in have) / len(have), sum(e for _, e in have) / len(have), len(have)))
    return out


def _line(
    protocol: Protocol,
    runs: Mapping[tuple[str, int], RunResult],
    flops: Mapping[tuple[str, int], float],
    plain: Mapping[int, float],
    points: int = 33,
) -> dict[str, list[tuple[float, float]]]:
    """Per baseline, (compute in FLOPs, mean endpoint over seeds) at `points` multiples spaced
    evenly in log between its measured ones, each seed's baseline there by the view's own log-log
    interpolation (cost.py `baseline_at`): the plot draws the curve the table reads, not a straight
    segment on a log axis. Only the seeds with every measured multiple; none below two multiples."""
    eq, out = protocol.equal_compute, {}
    for b in eq.baselines:
        names = [eq.name(b, m) for m in eq.multiples]
        seeds = [s for s in sorted(plain) if all((n, s) in flops for n in names)]
        at = {s: [Point(flops[(n, s)] / plain[s], runs[(n, s)].final) for n in names] for s in seeds}
        if len(names) < 2 or not seeds:
            out[b] = []
            continue
        lo = max(min(p.multiple for p in ps) for ps in at.values())
        hi = min(max(p.multiple for p in ps) for ps in at.values())
        grid = [lo * (hi / lo) ** (i / (points - 1)) for i in range(points)]
        scale = sum(plain[s] for s in seeds) / len(seeds)
        out[b] = [(m * scale, sum(baseline_at(at[s], m).endpoint for s in seeds) / len(seeds)) for m in grid]
    return out


# -- the report --------------------------------------------------------------------------------------


def _search_cell(r: ArmResult) -> list[str]:
    """The arm's search FLOPs per seed (`add_search`), mean over seeds."""
    f = r.compute.get("search_flops_mean")
    return ["" if f is None else f"{f / 1e15:.2f} PFLOP"]


def _total_pflops(r: ArmResult) -> float | None:
    f = r.compute.get("per_seed_mean", {}).get("train_flops_total")
    return None if f is None else f / 1e15


def _compute_tables(summary: dict[str, Any], protocol: Protocol, cols: int) -> list[str]:
    """View 2's table against each baseline, with the withheld arms' rows."""
    out = []
    for b in protocol.equal_compute.baselines:
        rows = summary["at_compute"][b]
        cap = baseline_capacity(protocol, b)
        part = {"results": [r.result for r in rows], "split": summary["split"]}
        table = arms_table(
            part,
            protocol.design,
            extra=[w.row(cols + 3) for w in summary["withheld"][b]],
            baseline=f"{b} at the arm's compute",
            more=("compute multiple (mean over seeds)", f"{b} there", "Holm"),
            cells=[
                r.cells(cap) + h
                for r, h in zip(rows, holm_cells(part["results"], summary["holm"][b], _secondary(protocol)))
            ],
        )
        out.append(f"### Against {b}\n\n{table}")
    return out


def _secondary(protocol: Protocol) -> dict[str, str]:
    return {a.name: a.secondary for a in protocol.arms if a.secondary}


def _notes(summary: dict[str, Any], protocol: Protocol = PROTOCOL) -> str:
    """Each arm's notes, the unfinished runs, the gate's, the withheld arms, the secondary arms
    (outside Holm's family, and why), the online arms' own gates, and the stages whose run
    directories are missing, once each."""
    results = summary["results"]
    held = [w.line() for ws in summary["withheld"].values() for w in ws]
    notes = [n for r in results for n in r.notes] + summary["unfinished"] + summary["gate"] + held
    notes += [
        f"{arm}: a secondary row, outside Holm's family and not judged for the comparison's question ({why})"
        for arm, why in _secondary(protocol).items()
    ]
    notes += [
        f"{arm}: its own pairs through the calibration's gate: {g.line()}" for arm, g in summary["own_gate"].items()
    ]
    notes += [
        f"{r.arm}: no run directory {m}; its compute leaves that stage out"
        for r in results
        for m in r.compute.get("missing", [])
    ]
    return "\n".join(f"- {n}" for n in dict.fromkeys(notes)) or "- none"


def format_markdown(summary: dict[str, Any], protocol: Protocol = PROTOCOL, command: str = "") -> str:
    from doremi.study.comparison.cost import VIEWS

    design, eq, g = protocol.design, protocol.equal_compute, protocol.guardrails
    rule = design.rule
    results, cols = summary["results"], ARM_COLUMNS
    holm = holm_cells(results, summary["holm"][EQUAL_TOKENS], _secondary(protocol))
    gates = summary["own_gate"]
    view1 = arms_table(
        summary,
        design,
        extra=[w.row(cols + 3) for w in summary["withheld"][EQUAL_TOKENS]],
        more=("of which search, per seed", "Holm", "gate on its own pairs (online)"),
        cells=[_search_cell(r) + h + [gate_cell(gates.get(r.arm), rule.mde)] for r, h in zip(results, holm)],
    )
    views2 = _compute_tables(summary, protocol, cols)
    note_text = _notes(summary, protocol)
    lines = "\n".join(f"- {_verdict(r, protocol, gates)}" for r in results if r.paired is not None)
    uniform_at = {
        "results": [r.result for r in summary["at_compute"].get(rule.baseline, [])],
        "domains": summary["domains"],
    }
    return f"""# The comparison: every mixing method against {rule.baseline}, {summary["pairs"]} pairs

Written by `{command}` from the raw logs; the protocol is doremi/study/comparison/protocol.py's
and the rule doremi/study/design.py's, fixed before the runs. Endpoint: mean {summary["split"]} loss
over domains at the final step (nats/token); differences are arm minus baseline, paired by seed
(negative: the arm is better). Every arm is judged on seeds {", ".join(map(str, summary["seeds"]))}; an arm
with fewer is {INCOMPLETE} (no verdict). Compute: model FLOPs per seed (doremi/reports/ledger.py
`train_flops_total`: training, a reference's forward, a target batch, validation passes, a sweep).

## View 1: {VIEWS[0]}

{lines or "- no arm complete"}

{view1}
## View 2: {VIEWS[1]}

Each baseline at the arm's compute multiple (1 + search FLOPs / the plain main run's, per seed),
its per-domain losses {eq.interpolation} (measured at {", ".join(f"{m}x" for m in eq.multiples)});
beyond the largest it is extrapolated, beyond {corpus_capacity(protocol):.2f}x no run is within the
2-epoch rule: both are flagged in the last column.

{chr(10).join(views2)}
## Guardrails

{guard_text(summary["guardrails"], summary["voids"], g.max_epochs, g.memorisation_gap, g.se_multiple)}

## Per domain, {VIEWS[0]} (mean over seeds ± SE)

{domain_table(summary, design) if len(results) > 1 else "no arm complete"}
## Per domain, {VIEWS[1]}, against {rule.baseline} (mean over seeds ± SE)

{domain_table(uniform_at, design) if uniform_at["results"] else "no arm complete"}
![comparison](comparison.png)

## Notes

{note_text}
"""


def _verdict(r: ArmResult, protocol: Protocol, gates: Mapping[str, GateDecision]) -> str:
    """The rule's verdict line, flagged for a secondary arm and an online arm its own gate refuses."""
    line = verdict_line(r, protocol.design)
    if protocol.arm(r.arm).secondary:
        line += " [secondary: outside Holm's family, not judged for the comparison]"
    g = gates.get(r.arm)
    if g is not None and not g.go:
        line += f" [NO-GO on its own pairs: needs {g.power_pairs or 'more than 100000'}; underpowered]"
    return line


def to_doc(summary: dict[str, Any]) -> dict[str, Any]:
    """comparison.json: view 1 as study.json's results, view 2 per baseline, the withheld arms,
    each view's Holm readings."""
    out = to_json({k: v for k, v in summary.items() if k not in ("at_compute", "withheld", "holm", "own_gate")})
    out["own_gate"] = {a: asdict(g) for a, g in summary["own_gate"].items()}
    out[EQUAL_COMPUTE] = {
        b: [{**to_json({"results": [r.result]})["results"][0], "at": [asdict(x) for x in r.at]} for r in rows]
        for b, rows in summary["at_compute"].items()
    }
    out["withheld"] = {v: [asdict(w) for w in ws] for v, ws in summary["withheld"].items()}
    out["holm"] = {v: {a: asdict(h) for a, h in arms.items()} for v, arms in summary["holm"].items()}
    return out


def plot(path: Path, summary: dict[str, Any], protocol: Protocol = PROTOCOL) -> None:
    """Mean test loss against total compute per seed: one point per arm, its bar the 95% interval
    of its paired difference from the baseline placed around its mean (the interval the verdict
    reads), and each baseline's measured multiples with the log-log curve between them that view 2
    interpolates on (`_line`)."""
    from matplotlib.figure import Figure

    from doremi.reports.report import _save

    fig = Figure(figsize=(8, 5), layout="constrained")
    ax = fig.subplots()
    for b, curve in summary["baseline_curve"].items():
        line = summary["baseline_line"].get(b, [])
        if curve:
            drawn = ax.plot([f / 1e15 for f, _, _ in curve], [e for _, e, _ in curve], "s", label=f"{b} (1x, 2x, ...)")
            if line:
                ax.plot([f / 1e15 for f, _ in line], [e for _, e in line], "--", color=drawn[0].get_color())
    for r in summary["results"]:
        x = _total_pflops(r)
        if x is None or r.paired is None:
            continue
        p = r.paired
        ax.errorbar([x], [r.mean_loss], yerr=[[p.mean - p.ci[0]], [p.ci[1] - p.mean]], fmt="o", capsize=4)
        ax.annotate(
            r.arm + (" (void)" if r.void else ""),
            (x, r.mean_loss),
            textcoords="offset points",
            xytext=(4, 4),
            fontsize=8,
        )
    ax.set_xscale("log")
    ax.set(
        xlabel="total compute per seed (search + main, PFLOP)",
        ylabel=f"mean {summary['split']} loss (nats/token)",
        title=f"{protocol.rule.ci_level:.0%} interval of the paired difference, {summary['pairs']} pairs",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path, png_metadata(COMMAND))


def run_comparison(
    sources: Sequence[str | Path],
    out: str | Path,
    protocol: Protocol = PROTOCOL,
    calibration: str | Path | None = None,
) -> dict[str, Any]:
    """Recompute the comparison from `sources` (directories or archives) into `out`. Every input
    is read and checked before anything is written."""
    paths, out = [Path(s) for s in sources], Path(out)
    for p in paths:
        check_source(p)
    gate = read_gate(calibration)
    check_outputs(out, (COMPARISON_JSON, COMPARISON_MD, COMPARISON_PNG), COMMAND)
    command = " ".join([COMMAND, *map(str, paths), "--out", str(out)])
    command += f" --calibration {calibration}" if calibration is not None else ""
    with tempfile.TemporaryDirectory(prefix="doremi-comparison-") as tmp:
        roots = [unpack(p, Path(tmp) / str(i)) if p.is_file() else p for i, p in enumerate(paths)]
        summary = compare(roots, protocol, gate)
        text = md_mark(COMMAND) + format_markdown(summary, protocol, command)
        doc = json.dumps({WRITTEN_BY: COMMAND, **to_doc(summary)}, indent=1, default=str) + "\n"
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / COMPARISON_JSON, doc)
        plot(out / COMPARISON_PNG, summary, protocol)
        atomic_write_text(out / COMPARISON_MD, text)
    for r in summary["results"]:
        if r.paired is not None:
            print(_verdict(r, protocol, summary["own_gate"]))
    for w in dict.fromkeys(w for ws in summary["withheld"].values() for w in ws):
        print(w.line())
    print(f"written: {out / COMPARISON_MD}, {out / COMPARISON_JSON}, {out / COMPARISON_PNG}")
    return summary
