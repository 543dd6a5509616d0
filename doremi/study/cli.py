"""`doremi study calibrate ROOT`, `doremi study summarize ARCHIVE_OR_DIR --out DIR` (docs/design.md
section 4e) and `doremi study compare-methods SOURCE [SOURCE ...] --out DIR` (section 4f). The last
is a verb like its siblings, named apart from the top-level `doremi compare` (mixtures of pipeline
roots, no protocol): it compares the comparison protocol's methods, from several archives (the
study's and the comparison's). Refusals (the gate's NO-GO, unfinished runs, missing partners)
are `StudyError`s: one line, exit status 2 (doremi/commands/cli.py)."""

from __future__ import annotations

import argparse


def cmd_calibrate(args: argparse.Namespace) -> None:
    from doremi.study.calibration import run_calibration

    run_calibration(args.root, args.out, args.budget_pairs, arm=args.arm)


def cmd_summarize(args: argparse.Namespace) -> None:
    from doremi.study.summarize import run_summary

    run_summary(args.source, args.out, calibration=args.calibration)


def cmd_compare_methods(args: argparse.Namespace) -> None:
    from doremi.study.comparison.summary import run_comparison

    run_comparison(args.sources, args.out, calibration=args.calibration)


def add_parser(sub) -> None:
    """The `study` command and its subcommands, on doremi/commands/cli.py's subparsers."""
    sp = sub.add_parser("study", help="a powered mixture study: calibration gate, verdict table")
    inner = sp.add_subparsers(dest="study_command", required=True)
    cal = inner.add_parser("calibrate", help="sigma_run, sigma_D, throughput and the go/no-go gate")
    cal.add_argument("root", metavar="ROOT", help="directory holding the calibration's <arm>-seed<k> run directories")
    cal.add_argument("--out", help="where calibration.json and calibration.md go (default: ROOT)")
    cal.add_argument(
        "--budget-pairs",
        type=int,
        default=None,
        metavar="N",
        help="most pairs the study may run (default: the design's)",
    )
    cal.add_argument(
        "--arm",
        default=None,
        metavar="NAME",
        help="the arm paired with the baseline (default: the design's fixed-weight arm); a method whose "
        "mixture comes from a search on every seed calibrates with pilot pairs of itself",
    )
    cal.set_defaults(fn=cmd_calibrate)
    summ = inner.add_parser("summarize", help="the study's table and verdict, recomputed from the raw logs")
    summ.add_argument("source", metavar="ARCHIVE_OR_DIR", help="run directories, or a .tar.xz/.tar.gz/.tar of them")
    summ.add_argument("--out", required=True, help="directory for study.md, study.json and study.png")
    summ.add_argument(
        "--calibration", help="the calibration's calibration.json: note arms with fewer pairs than its gate"
    )
    summ.set_defaults(fn=cmd_summarize)
    comp = inner.add_parser(
        "compare-methods", help="the comparison's table under both cost views, recomputed from its archives"
    )
    comp.add_argument(
        "sources",
        nargs="+",
        metavar="SOURCE",
        help="run directories, or .tar.xz/.tar.gz/.tar archives of them (the study's and the comparison's)",
    )
    comp.add_argument("--out", required=True, help="directory for comparison.md, comparison.json and comparison.png")
    comp.add_argument(
        "--calibration",
        help="the calibration's calibration.json: every arm needs its gate's pairs (default: the most any arm has)",
    )
    comp.set_defaults(fn=cmd_compare_methods)
    for p in (cal, summ, comp):
        p.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks for input errors"
        )
