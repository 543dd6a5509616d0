"""`doremi <stage> CONFIG.yaml [--set a.b=value ...]`, the same under torchrun.

Errors in the input (`data.errors.UserError`, whichever layer raised it), and operating-system
errors (permission denied, no space left, a path under a file, a read-only file system), are one
line on stderr naming the key, path or device and the cause, with exit status 2 (`--debug` shows
the traceback). Under torchrun only rank 0 prints it; the other ranks exit with the same status,
quietly."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from data.errors import UserError
from doremi.study.cli import add_parser as study_parser
from trainer.config.launch_env import is_launch_main
from trainer.run.interrupt import Interrupted


def describe_os_error(e: OSError) -> str:
    """One line: the path(s) and the cause (`runs/x/config.yaml: Read-only file system`)."""
    cause = e.strerror or str(e) or type(e).__name__
    if isinstance(e, FileExistsError) and e.filename is not None and Path(e.filename).is_file():
        cause += " (a file where a directory is expected)"  # mkdir(exist_ok=True) on a file
    paths = [str(p) for p in (e.filename, e.filename2) if p is not None]
    return f"{' -> '.join(paths)}: {cause}" if paths else cause


def _report(command: str, message: str) -> None:
    if not is_launch_main():
        return  # one copy of the error, from rank 0; the others' exit status says they stopped
    for line in message.splitlines() or [""]:
        print(f"doremi {command}: error: {line}", file=sys.stderr)


def _config(args: argparse.Namespace):
    from doremi.config import ExperimentConfig
    from trainer.config.schema import load_config

    return load_config(args.config, args.set, cls=ExperimentConfig)


def _print_losses(domains: list[str], losses) -> None:
    width = max(len(d) for d in domains + ["average"])
    print(f"{'domain':<{width}}  val_loss")
    for d, v in zip(domains, losses):
        print(f"{d:<{width}}  {v:.4f}")
    print(f"{'average':<{width}}  {float(sum(losses) / len(losses)):.4f}")
    print(f"{'worst':<{width}}  {float(max(losses)):.4f}  ({domains[int(losses.argmax())]})")


def cmd_preprocess(args):
    from data.preprocess.scale import run_preprocess

    cfg = _config(args)
    if not is_launch_main():
        return  # under torchrun, one process builds the stores
    from doremi.commands.inspect import inspect_stores

    manifest = run_preprocess(cfg.data, args.executor, args.tasks, force=args.force)
    print("\n".join(inspect_stores(Path(cfg.data.store_dir), n=0).splitlines()[1:]))  # tokenizer, per-domain counts
    print(f"stores in {cfg.data.store_dir}: {len(manifest.domains)} domains")


def _guard(cfg, kind: str, command: str) -> None:
    """A finished stage's guardrail findings, one line each on stderr (rank 0)."""
    from doremi.reports.guardrails import check_run, print_findings

    if is_launch_main():
        print_findings(check_run(cfg.train.run_dir, kind, cfg.pipeline.guardrails), prefix=f"doremi {command}")


def _stage_config(args: argparse.Namespace, stage: str):
    """The config of a training stage, its run directory resolved (`stages.default_run_dir`)."""
    from doremi.pipeline import stages

    return stages.with_run_dir(_config(args), args.config, stage)


def _pipeline_main_config(args: argparse.Namespace):
    """The config with `pipeline.main` applied as `doremi pipeline` applies it to its main runs
    (the file, `--set`, then the section on top); its default run directory `runs/<stem>/main`."""
    import dataclasses

    from doremi.pipeline import stages
    from doremi.pipeline.pipeline import Pipeline, deep_merge
    from trainer.config.tools import apply_overrides, read_yaml

    _config(args)  # the file as given, validated first: an error names the key as written
    raw = apply_overrides(read_yaml(args.config), list(args.set))
    cfg = Pipeline._load(deep_merge(raw, (raw.get("pipeline") or {}).get("main") or {}))
    if cfg.train.run_dir:
        return cfg
    run_dir = str(Path(stages.default_run_dir(args.config, "train")).parent / "main")
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, run_dir=run_dir))


def _model_words(cfg) -> str:
    m = cfg.model
    return f"d_model {m.d_model}, {m.n_layers} layers, {cfg.train.steps} steps"


def cmd_train(args):
    from doremi.pipeline import stages

    if args.pipeline_main:
        cfg = _pipeline_main_config(args)
    else:
        cfg = _stage_config(args, "train")
        if cfg.pipeline.main and is_launch_main():
            print(
                f"doremi train: note: {args.config} has a pipeline.main section, not applied: this trains the "
                f"config's own model ({_model_words(cfg)}); --pipeline-main trains the pipeline's main model",
                file=sys.stderr,
                flush=True,
            )
    stages.train(cfg)
    _guard(cfg, "main", "train")


def cmd_train_reference(args):
    from doremi.pipeline import stages

    cfg = _stage_config(args, "train-reference")
    stages.train_reference(cfg)
    _guard(cfg, "reference", "train-reference")


def cmd_train_proxy(args):
    from doremi.pipeline import stages

    cfg = _stage_config(args, "train-proxy")
    stages.train_proxy(cfg)
    if is_launch_main():
        run = cfg.train.run_dir
        print(
            f"domain weights per step in {run}/domain_weights.jsonl; `doremi average {run}` writes {run}/weights.json"
        )
    from doremi.methods.registry import spec

    _guard(cfg, "proxy" if spec(cfg.mixing.method).needs_reference else "method", "train-proxy")


def cmd_score(args):
    from doremi.methods.registry import reference_options
    from doremi.pipeline import stages

    cfg = _config(args)
    root = Path(cfg.train.run_dir) if cfg.train.run_dir else Path(stages.default_run_dir(args.config, "train")).parent
    out = stages.score(cfg, args.out or reference_options(cfg).reference_cache or str(root / "reference_cache"))
    if is_launch_main():
        print(f"reference losses cached in {out}")


def cmd_average(args):
    from data.sampling.weights_file import read_weights_file
    from doremi.errors import DoReMiError
    from doremi.pipeline import stages

    if len(args.run_dir) > 1 and not args.out:
        raise DoReMiError("average: --out is required with several runs (their pooled weights belong to no one run)")
    out = stages.average_runs(args.run_dir, args.out, args.from_step, args.allow_unfinished)
    tuned = read_weights_file(out)
    width = max(len(d) for d in tuned["domains"])
    for d, w in zip(tuned["domains"], tuned["weights"]):
        print(f"{d:<{width}}  {w:.4f}")
    print(f"written: {out}")


def cmd_eval(args):
    from doremi.pipeline import stages

    domains, losses = stages.evaluate(args.checkpoint, args.set)
    if is_launch_main():
        _print_losses(domains, losses)


def cmd_export(args):
    from doremi.commands.hf import export

    files = export(args.checkpoint, args.out_dir, args.max_shard_size, not args.no_tokenizer, args.force)
    print(f"exported {args.checkpoint} to {args.out_dir}: {', '.join(files)}")


def cmd_verify(args):
    from doremi.commands.verify import verify

    for line in verify(args.path):
        print(line)


def cmd_import(args):
    from doremi.commands.hf import import_yaml

    print(import_yaml(args.hf_dir, args.out), end="")


def _hf_parsers(sub) -> None:
    """`doremi export` and `doremi import`: the Hugging Face Llama format (doremi/commands/hf.py)."""
    sp = sub.add_parser("export", help="write a checkpoint as a Hugging Face Llama directory")
    sp.add_argument(
        "checkpoint", metavar="RUN_OR_CHECKPOINT", help="run directory (its latest checkpoint) or checkpoint"
    )
    sp.add_argument("out_dir", metavar="OUT_DIR", help="the Hugging Face directory to write")
    sp.add_argument("--max-shard-size", default="5GB", help="largest safetensors file before sharding (default 5GB)")
    sp.add_argument("--no-tokenizer", action="store_true", help="write the model without the run's tokenizer")
    sp.add_argument("--force", action="store_true", help="replace an existing OUT_DIR")
    sp.set_defaults(fn=cmd_export)
    sp = sub.add_parser("import", help="the model section of a run that starts from a Hugging Face Llama")
    sp.add_argument("hf_dir", metavar="HF_DIR", help="a Hugging Face Llama directory (config.json, safetensors)")
    sp.add_argument("--out", help="also write the sections to this YAML file")
    sp.set_defaults(fn=cmd_import)


def cmd_plan(args):
    from doremi.pipeline.plan_stages import plan_groups
    from trainer.config.schema import require_vocab_size
    from trainer.config.tools import ConfigError

    # The whole file validated first (a bad key is one line, before any planning); a plan needs
    # the vocabulary as a number (`auto` before the stores exist is one line too).
    require_vocab_size(_config(args))
    if args.gpus < 1:  # else each stage "cannot run on 0 GPUs" and the command exits 0
        raise ConfigError(f"--gpus: expected a positive number of GPUs, got {args.gpus}")
    if args.top < 0:
        raise ConfigError(f"--top: expected >= 0, got {args.top}")
    for group in plan_groups(args.config, args.set):
        print(_plan_group(group, args))


def tied_groups(items: list, key) -> list[list]:
    """`items` in order, those with the same displayed `key` as an earlier one gathered under
    it: layouts a small model cannot tell apart are one line, not ten."""
    groups: dict = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return list(groups.values())


def _plan_group(group, args) -> str:
    """Each stage of `group` as configured (dp from --gpus), the layouts that fit it (fastest
    first), and, when the configured one does not fit, one line saying what to change."""
    from trainer.config.tools import ConfigError
    from trainer.plan.layout_search import search
    from trainer.plan.memory import format_plan, human_bytes, human_seconds, plan_memory

    out, fits = [], True
    for name, cfg, frozen in group.stages:
        try:
            plan = plan_memory(cfg, args.gpus, args.gpu_memory, frozen_reference=frozen)
        except ConfigError as e:
            out.append(f"[{name}] as configured: cannot run on {args.gpus} GPUs: {e}\n")
            fits = False
            continue
        out.append(format_plan(plan, title=f"[{name}]") + "\n")
        fits = fits and plan.fits
    names = ", ".join(n for n, _, _ in group.stages)
    found = search(group.stages, args.gpus, args.gpu_memory)
    fitting = [c for c in found if c.fits]
    if not args.no_search:
        out.append(f"layouts of {args.gpus} GPUs that fit {args.gpu_memory:g} GiB for {names}, fastest first:")
        shown = 0
        for tied in tied_groups(fitting, lambda c: (human_bytes(c.peak_bytes), human_seconds(c.seconds))):
            if shown >= args.top:
                break
            c = tied[0]
            shown += 1
            out.append(
                f"  #{shown} {c.layout.describe()}: peak {human_bytes(c.peak_bytes)}, "
                f"predicted step {human_seconds(c.seconds)}  "
                f"({' '.join('--set ' + o for o in c.layout.overrides(group.prefix))})"
            )
            if len(tied) > 1:
                out.append(f"     tied with it ({len(tied) - 1}): " + "; ".join(t.layout.describe() for t in tied[1:]))
        if not fitting:
            out.append("  none")
        out.append("")
    if not fits:
        if fitting:
            best = fitting[0]
            out.append(
                f"{names}: does NOT fit as configured; change to {best.layout.describe()} "
                f"(peak {human_bytes(best.peak_bytes)}): {' '.join('--set ' + o for o in best.layout.overrides(group.prefix))}"
            )
        elif found:
            out.append(
                f"{names}: no layout of {args.gpus} GPUs fits {args.gpu_memory:g} GiB (the smallest peak is "
                f"{human_bytes(min(c.peak_bytes for c in found))}): use more GPUs or GPUs with more memory"
            )
        else:
            out.append(f"{names}: no valid layout of {args.gpus} GPUs for this config: change --gpus")
    return "\n".join(out)


def cmd_pipeline(args):
    from doremi.pipeline.pipeline import run_pipeline

    run_pipeline(args.config, args.set)


def cmd_sweep(args):
    from doremi.offline.sweep import run_sweep

    root = run_sweep(_config(args))
    print(f"sweep tables in {root}: mixtures.csv, losses.csv, final.csv")


def cmd_fit(args):
    from doremi.errors import DoReMiError
    from doremi.offline.propose import fit_quality, propose

    cfg = _config(args)
    sweeps = [Path(s) for s in args.sweep or [cfg.sweep.run_dir]]
    if len(sweeps) > 1 and not args.out:
        raise DoReMiError("fit: --out is required with several sweeps (their pooled fit belongs to no one sweep)")
    out = propose(
        cfg,
        args.method,
        args.out or sweeps[0] / f"{args.method}.json",
        sweeps if len(sweeps) > 1 else sweeps[0],
        allow_unfinished=args.allow_unfinished,
    )
    doc = json.loads(out.read_text())
    print(f"{args.method} weights: " + ", ".join(f"{d}={w:.3f}" for d, w in zip(doc["domains"], doc["weights"])))
    held = doc.get("held_out")
    if doc.get("held_out_skipped"):
        print(f"not checked on held-out runs: {doc['held_out_skipped']}")
    if held:
        print(f"held out ({held['folds']} folds): Spearman {held['spearman']:.3f}, mean abs error {held['mae']:.4f}")
    if "laws" in (quality := fit_quality(out)):
        print(f"mixing law: {quality['laws']}")
    print(f"written to {out}")


def _offline_methods() -> tuple[str, ...]:
    from doremi.methods.registry import OFFLINE, names

    return names(OFFLINE)


def cmd_compare(args):
    from doremi.study.compare import compare_roots

    print(compare_roots(args.roots, args.out, args.baseline, args.allow_differences))


def _plan_parser(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--gpus", type=int, required=True, help="GPUs in all; dp = GPUs / (tp x pp)")
    sp.add_argument("--gpu-memory", type=float, required=True, metavar="GIB", help="memory per GPU in GiB (2^30 bytes)")
    sp.add_argument("--no-search", action="store_true", help="plan the configured layout only, list no other layouts")
    sp.add_argument("--top", type=int, default=10, help="how many fitting layouts to list (default 10)")


def cmd_config(args):
    from doremi.commands.config import format_presets, resolved_yaml, stage_overview
    from doremi.commands.config_docs import experiment_keys, format_keys
    from doremi.errors import DoReMiError

    if args.presets:
        print(format_presets(), end="")
    elif args.keys:
        print(format_keys(experiment_keys()), end="")
    elif args.config is None:
        raise DoReMiError("expected CONFIG, --presets or --keys")
    else:
        text = resolved_yaml(args.config, args.set)
        try:
            overview = ["what it runs:", *stage_overview(args.config, args.set)]
        except UserError as e:  # the config loads, but `doremi pipeline` would refuse it
            overview = [f"what it runs: nothing; `doremi pipeline` would refuse it: {e}"]
        print("\n".join(f"# {line}" for line in overview))
        print(text, end="")


def cmd_inspect(args):
    from doremi.commands.inspect import inspect_stores, store_dir_of

    print(inspect_stores(store_dir_of(args.target, args.set), args.domain, args.n), end="")


def _config_parsers(sub) -> None:
    """`doremi config` and `doremi inspect`: look before running."""
    sp = sub.add_parser("config", help="print the resolved config, the model presets, or every key's doc")
    sp.add_argument("config", nargs="?", help="experiment YAML file")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    sp.add_argument("--presets", action="store_true", help="list the model presets with their sizes")
    sp.add_argument("--keys", action="store_true", help="document every config key (type, default, meaning)")
    sp.set_defaults(fn=cmd_config)
    sp = sub.add_parser("inspect", help="the token stores' summary and a few decoded documents per domain")
    sp.add_argument(
        "target",
        metavar="STORES_RUN_OR_CONFIG",
        help="a store directory, a run directory (the stores it trained on), or a config (its data.store_dir)",
    )
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    sp.add_argument("--domain", help="only this domain's documents")
    sp.add_argument("-n", type=int, default=2, help="documents per domain (default 2)")
    sp.set_defaults(fn=cmd_inspect)


def _debug_after_command(sub) -> None:
    """`--debug` after the command too (`doremi train X.yaml --debug`); SUPPRESS keeps the
    subcommand's absent flag from overwriting one given before it."""
    for sp in sub.choices.values():
        sp.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks for input errors"
        )


class _Version(argparse.Action):
    """`doremi --version`: the project's version and commit and the packages that change
    numbers, read only when asked (it runs git)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from doremi.environment import version_line

        print(version_line())
        parser.exit()


def _with_config(sub, name: str, fn, help: str) -> argparse.ArgumentParser:
    """A subcommand that takes an experiment config and `--set` overrides."""
    sp = sub.add_parser(name, help=help)
    sp.add_argument("config", help="experiment YAML file")
    sp.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set train.steps=10",
    )
    sp.set_defaults(fn=fn)
    return sp


def _stage_parsers(sub) -> None:
    """The subcommands that run a stage of an experiment from its config."""
    sp = _with_config(sub, "preprocess", cmd_preprocess, "tokenize each domain into token stores")
    sp.add_argument(
        "--force",
        action="store_true",
        help="rebuild even when the inputs are unchanged, and replace stores built from other inputs",
    )
    sp.add_argument(
        "--executor",
        choices=["local", "datatrove-local"],
        default="local",
        help="who runs the per-file tasks: ours (data.num_proc processes) or datatrove's local executor "
        "(--tasks shares; needs the extra [scale]); the stores' bytes are the same",
    )
    sp.add_argument("--tasks", type=int, help="shares of the build for --executor datatrove-local (default: num_proc)")
    _with_config(sub, "train", cmd_train, "train on data.domain_weights").add_argument(
        "--pipeline-main",
        action="store_true",
        help="apply the config's pipeline.main section, as `doremi pipeline` does for its main runs",
    )
    _with_config(sub, "train-reference", cmd_train_reference, "train the DoReMi reference model")
    _with_config(sub, "train-proxy", cmd_train_proxy, "train the DoReMi proxy (Group DRO over domains)")
    _with_config(sub, "score", cmd_score, "cache per-token reference losses for the proxy's data").add_argument(
        "--out", help="cache directory (default: mixing.<method>.reference_cache)"
    )
    _plan_parser(_with_config(sub, "plan", cmd_plan, "predict memory per rank and stage; search the layouts that fit"))
    _with_config(sub, "pipeline", cmd_pipeline, "run every stage of an experiment, skipping finished ones")
    _with_config(sub, "sweep", cmd_sweep, "train a small model on each of many designed mixtures (RegMix, mixing laws)")
    sp = _with_config(sub, "fit", cmd_fit, "propose a mixture from a sweep's table (RegMix or a data mixing law)")
    sp.add_argument("--method", required=True, choices=list(_offline_methods()), help="the offline method")
    sp.add_argument(
        "--sweep",
        nargs="+",
        help="the sweep directory (default: sweep.run_dir); several: one fit over all their runs, the same sweep "
        "but for its seeds (sweep.seed, train.seed, data.seed)",
    )
    sp.add_argument("--out", help="weights JSON path (default: SWEEP/<method>.json)")
    sp.add_argument(
        "--allow-unfinished", action="store_true", help="fit a sweep whose runs did not all finish (recorded)"
    )


def _artifact_parsers(sub) -> None:
    """The subcommands that read finished runs and checkpoints rather than a config."""
    sp = sub.add_parser(
        "average", help="average a proxy's per-step domain weights (several proxies: the mean of their averages)"
    )
    sp.add_argument("run_dir", nargs="+", metavar="RUN_DIR")
    sp.add_argument(
        "--from-step",
        type=int,
        default=None,
        help="first step averaged (default: the run's mixing.<method>.average_from_step)",
    )
    sp.add_argument("--out", help="weights JSON path (default RUN_DIR/weights.json; required with several runs)")
    sp.add_argument(
        "--allow-unfinished", action="store_true", help="average a run that did not finish (its header records it)"
    )
    sp.set_defaults(fn=cmd_average)

    sp = sub.add_parser("verify", help="check an artifact fully: stores, run, checkpoint, cache, weights, export")
    sp.add_argument("path", metavar="PATH")
    sp.set_defaults(fn=cmd_verify)

    sp = sub.add_parser("compare", help="paired multi-seed comparison of pipeline runs' mixtures")
    sp.add_argument("roots", nargs="+", metavar="ROOT", help="pipeline run directories, one per seed")
    sp.add_argument("--out", required=True, help="directory for compare.md and compare.png")
    sp.add_argument("--baseline", default="uniform", help="the main run every other is compared with")
    sp.add_argument(
        "--allow-differences",
        action="store_true",
        help="compare roots that differ in more than their seeds (the differences are listed)",
    )
    sp.set_defaults(fn=cmd_compare)

    sp = sub.add_parser("eval", help="per-domain validation loss of a checkpoint")
    sp.add_argument("checkpoint", help="run directory or checkpoint directory")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    sp.set_defaults(fn=cmd_eval)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="doremi", description="DoReMi data mixing on a 3D-parallel Llama trainer")
    p.add_argument("--version", action=_Version, help="the project's version and commit, and its packages' versions")
    p.add_argument("--debug", action="store_true", help="show tracebacks for input errors")
    sub = p.add_subparsers(dest="command", required=True)
    _stage_parsers(sub)
    _artifact_parsers(sub)
    _config_parsers(sub)
    _hf_parsers(sub)
    study_parser(sub)
    _debug_after_command(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.fn(args)
    except UserError as e:
        if args.debug:
            raise
        _report(args.command, str(e))
        return 2
    except OSError as e:
        if args.debug:
            raise
        _report(args.command, describe_os_error(e))
        return 2
    except Interrupted as e:
        if is_launch_main():
            print(f"doremi {args.command}: {e}", file=sys.stderr)
        return e.status
    except KeyboardInterrupt:
        return 130
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
