"""The comparison's guardrails, scoped to arms (protocol.py `Protocol.guardrail_scope = "arm"`;
docs/design.md section 4f).

The study voids itself when a guardrail of its rule fails (doremi/study/summarize.py
`guard_text`). With fourteen arms, one arm's breach says nothing of the others, so here a failing
guardrail voids the arms that use the run it failed on: an arm's own runs (its main run, its
search stages: DoReMi's reference and proxy of that seed) void that arm; a baseline's runs void
every arm judged against that baseline in the view that reads them (the rule's baseline at 1x:
view 1 and its view-2 table; a baseline at another multiple: its view-2 table only). The rest
stand.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from doremi.study.comparison.cost import EQUAL_COMPUTE, EQUAL_TOKENS
from doremi.study.comparison.protocol import Protocol

#: view (EQUAL_TOKENS, or a baseline's name for its equal-compute table) -> arm -> why it is void.
Voids = dict[str, dict[str, str]]


def voided_by(protocol: Protocol, run: str, stages: Mapping[str, Collection[str]]) -> dict[str, set[str]]:
    """Per view, the arms that a failing guardrail on the runs named `run` (any seed) voids;
    `stages`: each arm's search stage names (summary.py `search_stages`)."""
    eq, base = protocol.equal_compute, protocol.rule.baseline
    judged = {EQUAL_TOKENS: base, **{b: b for b in eq.baselines}}
    own = {a.name for a in protocol.arms if run == a.name or run in stages.get(a.name, ())}
    hit = {v: set(own) for v in judged}
    for b in eq.baselines:
        if run in {eq.name(b, m) for m in eq.multiples}:
            hit[b] = {a.name for a in protocol.arms}
            if run == base:
                hit[EQUAL_TOKENS] = {a.name for a in protocol.arms}
    return {v: arms - {judged[v], base} for v, arms in hit.items()}  # the rule's baseline is no arm


def void_reasons(
    protocol: Protocol, found: Sequence[tuple[tuple[str, int], Any]], stages: Mapping[str, Collection[str]]
) -> Voids:
    """Per view and arm, the guardrail findings (summarize.py `guardrail_warnings`: (name, seed)
    and its `Finding`) that void it, as "<check> of <run>", each once."""
    reasons: dict[str, dict[str, dict[str, None]]] = {}
    for (name, _), f in found:
        for view, arms in voided_by(protocol, name, stages).items():
            for arm in arms:
                reasons.setdefault(view, {}).setdefault(arm, {})[f"{f.check} of {f.run}"] = None
    return {v: {a: "; ".join(r) for a, r in sorted(arms.items())} for v, arms in reasons.items()}


def guard_text(messages: Sequence[str], voids: Voids, max_epochs: float, gap: float, se_multiple: float) -> str:
    """That every guardrail holds, or the findings and the arms each view voids (the others stand)."""
    if not messages:
        return (
            f"Every guardrail of the rule holds (memorisation gap - {se_multiple:g} SE <= {gap:g}; "
            f"epochs <= {max_epochs:g})."
        )
    lines = [f"- {m}" for m in messages]
    void = [
        f"- {view if view == EQUAL_TOKENS else f'{EQUAL_COMPUTE} against {view}'}: "
        + ", ".join(f"{a} ({r})" for a, r in arms.items())
        for view, arms in voids.items()
        if arms
    ]
    return (
        "**A guardrail of the rule failed: it voids the arms that use the run (the protocol's "
        "`guardrail_scope`); the others stand.**\n\n" + "\n".join(lines) + "\n\nVoid, by view:\n\n" + "\n".join(void)
    )
