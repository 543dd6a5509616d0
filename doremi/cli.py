"""`doremi <stage> CONFIG.yaml [--set a.b=value ...]`, the same under torchrun.

Errors in the input (`data.errors.UserError`, whichever layer raised it), and operating-system
errors (permission denied, no space left, a path under a file, a read-only file system), are one
line on stderr naming the key, path or device and the cause, with exit status 2 (`--debug` shows
the traceback). Under torchrun only rank 0 prints it; the other ranks exit with the same status,
quietly."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data.errors import UserError
from trainer.parallel.launch_env import is_launch_main


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
    from trainer.config import load_config

    return load_config(args.config, args.set, cls=ExperimentConfig)


def _print_losses(domains: list[str], losses) -> None:
    width = max(len(d) for d in domains + ["average"])
    print(f"{'domain':<{width}}  val_loss")
    for d, v in zip(domains, losses):
        print(f"{d:<{width}}  {v:.4f}")
    print(f"{'average':<{width}}  {float(sum(losses) / len(losses)):.4f}")
    print(f"{'worst':<{width}}  {float(max(losses)):.4f}  ({domains[int(losses.argmax())]})")


def cmd_preprocess(args):
    from data.preprocess import preprocess

    cfg = _config(args)
    if not is_launch_main():
        return  # under torchrun, one process builds the stores
    manifest = preprocess(cfg.data, force=args.force)
    print(f"stores in {cfg.data.store_dir}: {len(manifest.domains)} domains")


def _guard(cfg, kind: str, command: str) -> None:
    """A finished stage's guardrail findings, one line each on stderr (rank 0)."""
    from doremi.guardrails import check_run, print_findings

    if is_launch_main():
        print_findings(check_run(cfg.train.run_dir, kind, cfg.pipeline.guardrails), prefix=f"doremi {command}")


def cmd_train(args):
    from doremi import stages

    cfg = _config(args)
    stages.train(cfg)
    _guard(cfg, "main", "train")


def cmd_train_reference(args):
    from doremi import stages

    cfg = _config(args)
    stages.train_reference(cfg)
    _guard(cfg, "reference", "train-reference")


def cmd_train_proxy(args):
    from doremi import stages

    cfg = _config(args)
    stages.train_proxy(cfg)
    _guard(cfg, "proxy", "train-proxy")


def cmd_score(args):
    from doremi import stages

    cfg = _config(args)
    out = args.out or cfg.doremi.reference_cache or str(Path(cfg.train.run_dir) / "reference_cache")
    print(f"reference losses cached in {stages.score(cfg, out)}")


def cmd_average(args):
    from doremi import stages

    print(stages.average(args.run_dir, args.out, args.from_step))


def cmd_eval(args):
    from doremi import stages

    domains, losses = stages.evaluate(args.checkpoint, args.set)
    if is_launch_main():
        _print_losses(domains, losses)


def cmd_plan(args):
    from trainer.plan import format_plan, gpu_param_precision, plan_memory

    cfg = _config(args)
    print(
        format_plan(
            plan_memory(cfg, gpus=args.gpus, gpu_memory_gb=args.gpu_memory, param_precision=gpu_param_precision(cfg))
        )
    )


def cmd_pipeline(args):
    from doremi.pipeline import run_pipeline

    run_pipeline(args.config, args.set)


def cmd_compare(args):
    from doremi.compare import compare_roots

    print(compare_roots(args.roots, args.out, args.baseline))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="doremi", description="DoReMi data mixing on a 3D-parallel Llama trainer")
    p.add_argument("--debug", action="store_true", help="show tracebacks for input errors")
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(name: str, fn, help: str) -> argparse.ArgumentParser:
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

    with_config("preprocess", cmd_preprocess, "tokenize each domain into token stores").add_argument(
        "--force", action="store_true", help="rebuild even when the inputs are unchanged"
    )
    with_config("train", cmd_train, "train on data.domain_weights")
    with_config("train-reference", cmd_train_reference, "train the DoReMi reference model")
    with_config("train-proxy", cmd_train_proxy, "train the DoReMi proxy (Group DRO over domains)")
    with_config("score", cmd_score, "cache per-token reference losses for the proxy's data").add_argument(
        "--out", help="cache directory (default: doremi.reference_cache)"
    )
    sp = with_config("plan", cmd_plan, "predict memory per rank and pipeline stage")
    sp.add_argument("--gpus", type=int, required=True)
    sp.add_argument("--gpu-memory", type=float, required=True, help="GB per GPU")
    with_config("pipeline", cmd_pipeline, "run every stage of an experiment, skipping finished ones")

    sp = sub.add_parser("average", help="average a proxy's per-step domain weights")
    sp.add_argument("run_dir")
    sp.add_argument(
        "--from-step", type=int, default=None, help="first step averaged (default: the run's doremi.average_from_step)"
    )
    sp.add_argument("--out", help="weights JSON path (default RUN_DIR/weights.json)")
    sp.set_defaults(fn=cmd_average)

    sp = sub.add_parser("compare", help="paired multi-seed comparison of pipeline runs' mixtures")
    sp.add_argument("roots", nargs="+", metavar="ROOT", help="pipeline run directories, one per seed")
    sp.add_argument("--out", required=True, help="directory for compare.md and compare.png")
    sp.add_argument("--baseline", default="uniform", help="the main run every other is compared with")
    sp.set_defaults(fn=cmd_compare)

    sp = sub.add_parser("eval", help="per-domain validation loss of a checkpoint")
    sp.add_argument("checkpoint", help="run directory or checkpoint directory")
    sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    sp.set_defaults(fn=cmd_eval)
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
    except KeyboardInterrupt:
        return 130
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
