"""`doremi pipeline EXPERIMENT.yaml`: preprocess -> reference -> proxy -> average (x rounds) ->
main runs (DoReMi weights and baselines) -> per-domain eval -> report.

Each stage writes `stage.started.json` (its config fingerprint) when it starts and `stage.json`
when it completes (`doremi.outputs.stage_markers`). The fingerprint covers the keys the stage reads
(`doremi.outputs.fingerprint`: the reference none of its method's options but its mixture, the main
runs none of `mixing`): a stage whose output exists for unchanged keys is kept, one whose keys changed is
redone from scratch, the changed keys printed, its finished output kept under
`ROOT/previous/` (a sweep's earlier points are not overwritten); one interrupted mid-way under
the same keys resumes from its last checkpoint. The pipeline holds its run directory's lock
(trainer/records/run_dir.py) for its life, and each training stage's directory while it runs.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import re
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from data import artifact
from data.sampling.pools import pool_sizes
from data.sampling.weights_file import WEIGHTS_FILE, copy_weights_file, read_weights_file
from data.store.store import read_manifest
from doremi.config import OFFLINE_METHODS, ExperimentConfig
from doremi.methods.registry import spec
from doremi.offline.propose import check_fit_quality, describe_quality, fit_quality, propose
from doremi.offline.sweep import run_sequences, run_sweep, sweep_keys
from doremi.outputs.fingerprint import (  # noqa: F401 (store_fingerprint: imported from here by tests)
    MAIN_IGNORES,
    METHOD_IGNORES,
    PROXY_IGNORES,
    REFERENCE_IGNORES,
    REFERENCE_READS,
    fingerprint,
    stage_keys,
    store_fingerprint,
    store_keys,
)
from doremi.outputs.main_runs import (
    REFERENCE_RUN,
    SWEEP_DIR,
    method_dir,
    mixtures,
    online_run_name,
    search_dir,
    search_folders,
)
from doremi.outputs.stage_markers import (
    EVAL_OUTPUT,
    PREVIOUS_DIR,
    done_marker,
    kept_path,
    read_marker,
    remove_marker_temps,
    started_marker,
    write_done,
    write_started,
)
from doremi.pipeline import stages
from doremi.pipeline.validate import validate_pipeline
from doremi.reports.summary import log_comparison, summarize
from trainer.config.launch_env import is_launch_main, launch_world_size
from trainer.config.schema import apply_preset
from trainer.config.tools import apply_overrides, from_dict, read_yaml, to_dict
from trainer.model.flops import non_embedding_params
from trainer.records import run_dir as rundir


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class Pipeline:
    def __init__(
        self, path: str | os.PathLike, overrides: list[str] | None = None, say: Callable[[str], None] | None = None
    ):
        self.raw = apply_overrides(read_yaml(path), list(overrides or []))
        self.cfg = self._load(self.raw)
        self.p = self.cfg.pipeline
        self.root = Path(self.p.run_dir)
        validate_pipeline(self)  # every stage's config, weights file and baseline, before any work
        self.say = say or (lambda msg: print(msg, flush=True) if is_launch_main() else None)
        self._t0 = time.perf_counter()
        self._made: dict[str, Any] | None = None
        if launch_world_size() > 1:
            # Under torchrun: one process group for the whole pipeline, so that the stages'
            # file-system work is done by rank 0 alone and the others wait for it.
            from trainer.build import init_parallel

            init_parallel(self.cfg)

    @staticmethod
    def _load(raw: dict[str, Any]) -> ExperimentConfig:
        raw = copy.deepcopy(raw)
        apply_preset(raw)
        return from_dict(ExperimentConfig, raw)

    def stage_config(self, section: dict[str, Any], **sets: Any) -> ExperimentConfig:
        """A stage's config: the file, the stage's section, `sets`; wandb groups the stage's run
        with the pipeline's others under the pipeline's name unless `logging.wandb_group` says
        otherwise (logging is no stage's fingerprint)."""
        raw = deep_merge(self.raw, section)
        raw = apply_overrides(raw, [f"{k.replace('__', '.')}={json.dumps(v)}" for k, v in sets.items()])
        cfg = self._load(raw)
        if cfg.logging.wandb and not cfg.logging.wandb_group:
            cfg = dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, wandb_group=self.root.name))
        return cfg

    # -- stage bookkeeping -------------------------------------------------------------------
    def _run_stage(
        self,
        name: str,
        out: Path,
        keys: dict[str, Any],
        fn: Callable[[], Any],
        clean: bool = True,
        main_only: bool = False,
    ) -> Any:
        """Run `fn` unless `out` holds its result for `keys` (the config keys the stage reads:
        `doremi.outputs.fingerprint`). A finished output made under other keys is redone, the changed
        keys named, and (with `clean`) kept under `ROOT/previous/` rather than overwritten, so
        that a sweep's earlier points stay (`kept_path`). `clean`: the stage owns `out`, and a
        stale one is moved or removed before redoing it. `main_only`: `fn` only touches files,
        so rank 0 runs it while the other ranks wait."""
        marker = done_marker(out)
        started = started_marker(marker)
        fp = fingerprint(keys)
        previous: dict[str, Any] | None = None
        stale = False
        if marker.is_file():
            previous = read_marker(marker)
            if previous.get("fingerprint") == fp:
                self.say(f"[{self._elapsed()}] {name}: done already ({out}), skipped")
                return previous.get("result")
            stale = True
        elif started.is_file() and read_marker(started).get("fingerprint") != fp:
            self.say(f"[{self._elapsed()}] {name}: interrupted under another config, redoing from scratch")
            stale = True
        kept = kept_path(self.root, out, previous["fingerprint"]) if previous is not None and clean else None
        if previous is not None:
            changed = (
                rundir.changed_keys(previous["keys"], keys)
                if "keys" in previous
                else "(the previous run recorded no keys: made by an older version)"
            )
            where = f"; the previous output is kept in {kept}" if kept is not None else ""
            self.say(f"[{self._elapsed()}] {name}: redone, config changed: {changed}{where}")
        with contextlib.ExitStack() as stack:
            if clean and out.suffix == "":
                rundir.on_rank0(lambda: stack.enter_context(rundir.locked(out)), is_launch_main())
            if stale and is_launch_main():
                if kept is not None:
                    self._keep(out, marker, kept)
                marker.unlink(missing_ok=True)  # another pipeline sharing the stage may have gone first
                if clean and out.is_dir():
                    rundir.clear(out)
            barrier()
            if is_launch_main():
                write_started(marker, name, fp)
            self.say(f"[{self._elapsed()}] {name} ...")
            t0 = time.perf_counter()
            result = fn() if is_launch_main() or not main_only else None
            barrier()
            if is_launch_main():
                write_done(marker, name, fp, result, keys, seconds=time.perf_counter() - t0)
            barrier()
        return result

    @staticmethod
    def _keep(out: Path, marker: Path, kept: Path) -> None:
        """Move the finished output `out` (a run directory but its lock, or a file) and its
        marker to `kept`, replacing an output of the same keys kept before."""
        if kept.is_dir():
            shutil.rmtree(kept)
        kept.unlink(missing_ok=True)
        done_marker(kept).unlink(missing_ok=True)
        kept.parent.mkdir(parents=True, exist_ok=True)
        if out.suffix == "":
            kept.mkdir()
            for entry in out.iterdir():
                if entry.name != rundir.LOCK_FILE:
                    entry.rename(kept / entry.name)
            return
        if out.exists():
            out.rename(kept)
        if marker.exists():
            marker.rename(done_marker(kept))

    def _elapsed(self) -> str:
        s = int(time.perf_counter() - self._t0)
        return f"{s // 60:02d}:{s % 60:02d}"

    # -- the stages ----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        with contextlib.ExitStack() as stack:

            def own() -> None:
                self._check_root()
                stack.enter_context(rundir.locked(self.root))

            rundir.on_rank0(own, is_launch_main())
            if is_launch_main():
                remove_marker_temps(self.root)
                self._write_header("running")
            barrier()
            try:
                results = self._run()
            except BaseException:
                if is_launch_main():
                    with contextlib.suppress(Exception):  # the error that stopped it is the one to show
                        self._write_header("interrupted")
                raise
            if is_launch_main():
                self._write_header("finished")
            return results

    def _check_root(self) -> None:
        """The root is new, a pipeline root, or holds nothing where the pipeline writes (its
        report, plots, weights, stage directories): a folder's `report.md` would be overwritten,
        stores would take a pipeline's outputs (docs/design.md section 6b). A root made before
        headers is known by its stage markers."""
        if any(self.root.glob("*.stage.json")) or any(self.root.glob("*/*/stage.json")):
            return
        ours = {"report.md", WEIGHTS_FILE, "main", "methods", PREVIOUS_DIR, SWEEP_DIR}
        artifact.check_output_dir(
            self.root,
            "pipeline",
            "pipeline.run_dir",
            lambda name: name in ours or name.endswith((".png", ".stage.json")) or re.fullmatch(r"round\d+", name),
        )

    def _write_header(self, status: str) -> None:
        """The root's artifact header (`ROOT/artifact.json`, data/artifact.py): a pipeline root,
        its status, the fingerprint of the experiment (every key but where it writes and how it
        logs) and, once preprocessing ran, the stores it read. `doremi compare` and `doremi
        verify` read it; a command that replaces only its own output refuses the root."""
        keys = {k: v for k, v in self.raw.items() if k != "logging"}
        keys["pipeline"] = {k: v for k, v in dict(keys.get("pipeline") or {}).items() if k != "run_dir"}
        sources = []
        manifest = Path(self.cfg.data.store_dir) / "manifest.json"
        if manifest.is_file():
            sources.append(artifact.Source("stores", str(manifest.parent), store_fingerprint(self.cfg)))
        self.root.mkdir(parents=True, exist_ok=True)
        artifact.write(
            self.root,
            artifact.Header("pipeline", status=status, fingerprint=artifact.content_hash(keys), sources=sources),
            self._made_by(),
        )

    def _made_by(self) -> dict[str, Any]:
        """What made this root: the command line, the project's commit and the packages'
        versions (doremi/environment.py), and the resolved config."""
        if self._made is None:
            from doremi.environment import environment

            self._made = {
                "command": shlex.join(["doremi", *sys.argv[1:]]) if sys.argv and sys.argv[0] else None,
                "environment": environment(),
                "config": to_dict(self.cfg),
            }
        return self._made

    def _run(self) -> dict[str, Any]:
        from data.preprocess.preprocess import preprocess

        cfg = self.cfg
        # `preprocess` itself refuses stores built from other inputs; the marker skips even its
        # check when none of the keys the stores depend on changed, so that runs differing only
        # in how they sample (data.seed, data.domain_weights, seq_len) share one store
        # directory, also concurrently.
        self._run_stage(
            "preprocess",
            Path(cfg.data.store_dir),
            store_keys(cfg),
            lambda: (preprocess(cfg.data), None)[1],
            clean=False,
            main_only=True,
        )
        weights_path = self.root / WEIGHTS_FILE
        tuned: dict[str, str] = {}
        for name in self.p.methods:
            if name == REFERENCE_RUN:
                tuned[name] = str(self.tune_weights(name))
            elif name in OFFLINE_METHODS:
                tuned[name] = str(self.offline(name))
            else:
                tuned[name] = str(self.method_proxy(name))
        results: dict[str, Any] = {"weights": tuned}
        results["guardrails"] = self.guard(main=False)
        if not self.p.skip_main:
            results["main"] = self.main_runs(weights_path)
            results["guardrails"] += self.guard(main=True)
        return results

    def guard(self, main: bool) -> list[Any]:
        """Check the reference and proxy runs (`main` false) or the main runs (`main` true);
        print each warning on stderr. Under `pipeline.strict`, warnings about the reference or
        proxy stop the pipeline (GuardrailError, exit status 2) before any main run starts."""
        from doremi.reports.guardrails import GuardrailError, findings, measure_pipeline, print_findings, warnings

        manifest = read_manifest(self.cfg.data.store_dir)
        measures = [m for m in measure_pipeline(self.root, main=main, manifest=manifest) if (m.kind == "main") == main]
        found = [f for m in measures for f in findings(m, self.p.guardrails)]
        if self.p.strict and not main and warnings(found):
            raise GuardrailError(warnings(found))
        if is_launch_main():
            self.say(
                f"[{self._elapsed()}] guardrails ({'main runs' if main else 'reference and proxy'}): "
                f"{len(warnings(found))} warnings"
            )
            print_findings(found, prefix="doremi pipeline")
        return found

    def tune_weights(self, name: str) -> Path:
        """Method `name`, which needs a reference: per round its reference, its proxy and the
        average (of `pipeline.searches` of them, `search_dir`), round r + 1's reference on round
        r's weights, until `rounds` or the weights move less than `rounds_tolerance`."""
        dcfg = getattr(self.cfg.mixing, name)
        ref_weights: Any = dcfg.reference_weights
        previous: np.ndarray | None = None
        weights_path = self.root / WEIGHTS_FILE
        for r in range(1, dcfg.rounds + 1):
            rdir = self.root / f"round{r}"
            self.set_aside_other_searches(rdir, ("reference", "proxy"))
            proxies = [self.reference_search(name, r, i, ref_weights) for i in range(1, self.p.searches + 1)]
            proxy_cfg = proxies[-1][1]
            avg_path = rdir / WEIGHTS_FILE
            from_step = getattr(proxy_cfg.mixing, name).average_from_step
            self._run_stage(
                f"round {r}: average",
                avg_path,
                self.average_keys([stage_keys(c, PROXY_IGNORES) for _, c in proxies]),
                lambda: str(stages.average_runs([p for p, _ in proxies], avg_path, from_step)),
                main_only=True,
            )
            tuned = read_weights_file(avg_path)
            weights = np.array(tuned["weights"])
            self.say("           weights: " + ", ".join(f"{d}={w:.3f}" for d, w in zip(tuned["domains"], weights)))
            if is_launch_main():
                copy_weights_file(avg_path, weights_path)
            barrier()
            ref_weights = str(avg_path)
            if previous is not None and np.abs(weights - previous).max() < dcfg.rounds_tolerance:
                self.say(f"           converged after round {r} (max change < {dcfg.rounds_tolerance})")
                break
            previous = weights
        return weights_path

    def reference_search(self, name: str, r: int, i: int, ref_weights: Any) -> tuple[Path, Any]:
        """Round `r`'s search `i` of method `name`: its reference on `ref_weights`, then its
        proxy against that reference; returns the proxy's run directory and config."""
        sdir, seeds = search_dir(self.root / f"round{r}", i, self.p.searches), self.search_seeds(i)
        where = f"round {r}" + (f", search {i}" if self.p.searches > 1 else "")
        ref_cfg = self.stage_config(
            self.p.proxy,
            train__run_dir=str(sdir / "reference"),
            **seeds,
            **{f"mixing__{name}__reference_weights": ref_weights},
        )
        self._run_stage(
            f"{where}: reference",
            sdir / "reference",
            stage_keys(ref_cfg, REFERENCE_IGNORES, REFERENCE_READS),
            lambda: (stages.train_reference(ref_cfg), None)[1],
        )
        proxy_cfg = self.stage_config(
            self.p.proxy,
            train__run_dir=str(sdir / "proxy"),
            mixing__method=name,
            **seeds,
            **{
                f"mixing__{name}__reference": str(sdir / "reference"),
                f"mixing__{name}__reference_weights": ref_weights,
            },
        )
        self._run_stage(
            f"{where}: proxy",
            sdir / "proxy",
            stage_keys(proxy_cfg, PROXY_IGNORES),
            lambda: (stages.train_proxy(proxy_cfg), None)[1],
        )
        return sdir / "proxy", proxy_cfg

    def set_aside_other_searches(self, stage_dir: Path, runs: tuple[str, ...]) -> None:
        """Move under ROOT/previous/ what `stage_dir` holds of another `pipeline.searches`: the
        `search<i>/` folders beyond this pipeline's (all of them with one search), or with several
        searches the `runs` of one search kept in the directory itself. The reports, the ledger
        and the guardrails read the searches they find there (`search_dirs`)."""
        if is_launch_main() and stage_dir.is_dir():
            k = self.p.searches
            stale = [p for p in search_folders(stage_dir) if k == 1 or int(p.name[6:]) > k]
            stale += [stage_dir / r for r in runs if k > 1 and (stage_dir / r).exists()]
            for path in stale:
                dest = self.root / PREVIOUS_DIR / path.relative_to(self.root)
                if dest.exists():
                    shutil.rmtree(dest)
                dest.parent.mkdir(parents=True, exist_ok=True)
                path.rename(dest)
                self.say(f"[{self._elapsed()}] {path}: another pipeline.searches' run, kept in {dest}")
        barrier()

    def search_seeds(self, search: int) -> dict[str, int]:
        """The seeds of search `search`: the experiment's for the first, each plus search - 1 for
        the others (no override with one search, so its stages' keys are those of before)."""
        if self.p.searches == 1:
            return {}
        return {"train__seed": self.cfg.train.seed + search - 1, "data__seed": self.cfg.data.seed + search - 1}

    def average_keys(self, keys: list[dict[str, Any]]) -> dict[str, Any]:
        """The average stage's keys: its proxy's, or with several searches each search's."""
        return keys[0] if len(keys) == 1 else {f"search{i}": k for i, k in enumerate(keys, start=1)}

    def method_proxy(self, name: str) -> Path:
        """A mixing method that needs no reference as a proxy: its run (`pipeline.searches` of
        them, `search_dir`) and its averaged weights under `methods/<name>/`."""
        mdir = method_dir(self.root, name)
        self.set_aside_other_searches(mdir, ("proxy",))
        proxies, keys = [], []
        for i in range(1, self.p.searches + 1):
            sdir = search_dir(mdir, i, self.p.searches)
            cfg = self.stage_config(
                self.p.proxy, train__run_dir=str(sdir / "proxy"), mixing__method=name, **self.search_seeds(i)
            )
            keys.append(stage_keys(cfg, METHOD_IGNORES, ("mixing.method", f"mixing.{name}")))
            label = f"{name}: proxy" + (f" (search {i})" if self.p.searches > 1 else "")
            self._run_stage(label, sdir / "proxy", keys[-1], lambda: (stages.train_proxy(cfg), None)[1])
            proxies.append(sdir / "proxy")
        avg = mdir / WEIGHTS_FILE
        self._run_stage(
            f"{name}: average",
            avg,
            self.average_keys(keys),
            lambda: str(stages.average_runs(proxies, avg)),
            main_only=True,
        )
        tuned = read_weights_file(avg)
        self.say("           weights: " + ", ".join(f"{d}={w:.3f}" for d, w in zip(tuned["domains"], tuned["weights"])))
        return avg

    def sweep(self) -> Path:
        """The sweep of small runs the offline methods share (`sweep/`, the proxy's model and
        steps under `pipeline.proxy`), run once whatever the number of methods fitting it."""
        out = self.root / SWEEP_DIR
        cfg = self.stage_config(self.p.proxy, sweep__run_dir=str(out))
        self._run_stage("sweep", out, sweep_keys(cfg), lambda: (run_sweep(cfg), None)[1])
        return out

    def offline(self, name: str) -> Path:
        """An offline method: the shared sweep, then its fit, the proposal capped against the
        main runs' token budget, in `methods/<name>/weights.json`."""
        sweep = self.sweep()
        out = method_dir(self.root, name) / WEIGHTS_FILE
        cfg = self.stage_config(self.p.proxy, sweep__run_dir=str(sweep))
        main = self.stage_config(self.p.main)
        budget, params = main.budget_tokens, non_embedding_params(main.model)
        keys = {
            **sweep_keys(cfg),
            **{k: v for k, v in stage_keys(cfg).items() if k.startswith("fit.")},
            "method": name,
            "main budget": budget,
            **({"main params": params} if spec(name).fit_reads_main_size else {}),
            **(
                {"main sequences": run_sequences(main), "main pools": pool_sizes(main.data)}
                if cfg.fit.max_epochs is not None
                else {}
            ),
        }
        self._run_stage(
            f"{name}: fit",
            out,
            keys,
            lambda: str(propose(cfg, name, out, sweep, budget, main_params=params, main=main)),
            main_only=True,
        )
        tuned = read_weights_file(out)
        self.say("           weights: " + ", ".join(f"{d}={w:.3f}" for d, w in zip(tuned["domains"], tuned["weights"])))
        if self.p.skip_main:
            self.say(f"           {describe_quality(fit_quality(out))}")
        else:  # before any main run trains on it (docs/design.md section 4d)
            self.say(f"           {check_fit_quality(name, out, self.p.guardrails.min_fit_spearman)}")
        return out

    def mixtures(self, weights_path: Path) -> dict[str, str]:
        return mixtures(weights_path, self.p.baselines, self.p.methods)

    def main_runs(self, weights_path: Path) -> dict[str, Any]:
        out: dict[str, Any] = {}
        runs = [
            (
                name,
                self.stage_config(
                    self.p.main,
                    train__run_dir=str(self.root / "main" / name),
                    data__domain_weights=w,
                    mixing__main=None,
                ),
            )
            for name, w in self.mixtures(weights_path).items()
        ]
        runs += [
            (
                online_run_name(m),
                self.stage_config(
                    self.p.main, train__run_dir=str(self.root / "main" / online_run_name(m)), mixing__main=m
                ),
            )
            for m in self.p.online
        ]
        for name, cfg in runs:
            run_dir = Path(cfg.train.run_dir)
            online = cfg.mixing.main
            keys = stage_keys(cfg, MAIN_IGNORES, ("mixing.main", f"mixing.{online}") if online else ())
            self._run_stage(
                f"main run: {name}", run_dir, keys, lambda: (stages.train(cfg, desc=f"main:{name}"), None)[1]
            )
            result = self._run_stage(f"eval: {name}", run_dir / EVAL_OUTPUT, keys, lambda: self._eval(run_dir))
            out[name] = result
        return out

    def _eval(self, run_dir: Path) -> dict[str, Any]:
        domains, losses = stages.evaluate(run_dir)
        return {"domains": domains, "val_loss": [float(x) for x in losses]}


def run_pipeline(path: str | os.PathLike, overrides: list[str] | None = None) -> dict[str, Any]:
    pipe = Pipeline(path, overrides)
    results = pipe.run()
    if is_launch_main() and "main" in results:
        print(summarize(pipe.root, pipe.cfg.data.store_dir, pipe.p.baselines, pipe.p.guardrails), flush=True)
        log = pipe.cfg.logging
        if log.wandb:
            log_comparison(
                pipe.root,
                pipe.cfg.data.store_dir,
                pipe.p.baselines,
                log.wandb_project,
                log.wandb_group or pipe.root.name,
            )
    return results
