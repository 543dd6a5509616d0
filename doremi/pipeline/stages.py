"""The stage commands of docs/design.md section 1, as functions of a config.

`doremi <stage> CONFIG` calls these; `doremi pipeline` chains them. Each returns the path it
produced so that the pipeline can pass it on.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from data import artifact
from data.progress import Countdown
from data.sampling.weights import resolve_weights
from data.sampling.weights_file import WEIGHTS_FILE, write_weights_file
from data.store.batch import collate
from doremi.config import METHODS, ExperimentConfig, load_saved_config
from doremi.errors import DoReMiError
from doremi.methods.history import average_weights, read_history
from doremi.methods.reference import OnlineReference, load_frozen, reference_config, require_reference, run_dir_of
from doremi.methods.reference_cache import (
    check_out,
    create_arrays,
    open_for_scoring,
    publish,
    reference_stamp,
    staging_dir,
)
from doremi.methods.registry import method_factory, reference_method, reference_options, spec, specs
from doremi.methods.registry import options as registry_options
from doremi.outputs.fingerprint import MAIN_IGNORES, OFFLINE_SECTIONS
from doremi.pipeline.validate import check_online, check_stage
from trainer.build import RunFacts, init_parallel
from trainer.checkpoint.checkpoint import resolve_checkpoint
from trainer.config.tools import ConfigError, read_yaml
from trainer.feed.data_feed import DataFeed
from trainer.records.run_dir import recorded_stage, require_finished
from trainer.run.evaluate import evaluate_domains
from trainer.run.loop import Trainer

#: Training stage -> the directory name of its default run directory, and the stage its run
#: directory records (trainer.records.run_dir.check_stage).
STAGE_DIRS = {"train": "train", "train-reference": "reference", "train-proxy": "proxy"}


def default_run_dir(config_path: str | Path, stage: str) -> str:
    """`runs/<config stem>/<stage>`: two stages, or two configs, never share a directory unless
    `train.run_dir` says so (a baseline trained into a DoReMi run's directory would resume it)."""
    return str(Path("runs") / Path(config_path).stem / STAGE_DIRS[stage])


def with_run_dir(cfg: ExperimentConfig, config_path: str | Path, stage: str) -> ExperimentConfig:
    """`cfg` with its run directory resolved (`default_run_dir` when train.run_dir is unset)."""
    if cfg.train.run_dir:
        return cfg
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, run_dir=default_run_dir(config_path, stage)))


def with_weights(cfg: ExperimentConfig, weights: Any) -> ExperimentConfig:
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, domain_weights=weights))


def train(cfg: ExperimentConfig, desc: str = "train", stage: str = "train") -> dict[str, Any]:
    """Training on `data.domain_weights` (the large run with tuned weights), or with the
    method `mixing.main` online. The `doremi` section (and `mixing`, unless a method runs) does
    not enter its results, so changing it does not stop a resume."""
    online = cfg.mixing.main if stage == "train" else None
    if online is None:
        return Trainer(cfg, desc=desc, result_ignore=MAIN_IGNORES, stage=stage).fit()
    check_online(cfg)
    return Trainer(
        cfg,
        desc=f"{desc}:{online}",
        result_ignore=(*ExperimentConfig.MOVED, *OFFLINE_SECTIONS),
        stage=stage,
        method=method_factory(online, cfg),
    ).fit()


def train_reference(cfg: ExperimentConfig) -> dict[str, Any]:
    check_stage(cfg, "train-reference")  # refuses a data.domain_weights it would ignore
    return train(with_weights(cfg, reference_options(cfg).reference_weights), desc="reference", stage="reference")


def train_proxy(cfg: ExperimentConfig) -> dict[str, Any]:
    """The proxy of `mixing.method` (a method that needs a reference, e.g. DoReMi's Group DRO
    over domains, against the frozen reference); its per-step weights are what `average` averages."""
    check_stage(cfg, "train-proxy")  # refuses a data.domain_weights it would ignore
    return proxy_trainer(cfg).fit()


def proxy_trainer(cfg: ExperimentConfig) -> Trainer:
    """The proxy's trainer, its method (and the reference of a method that needs one) plugged in."""
    name = cfg.mixing.method
    desc = "proxy" if spec(name).needs_reference else f"proxy:{name}"
    return Trainer(cfg, desc=desc, stage="proxy", method=method_factory(name, cfg), result_ignore=OFFLINE_SECTIONS)


def score(cfg: ExperimentConfig, out_dir: str | Path) -> Path:
    """Cache per-token reference losses for every sequence the proxy's data stream visits.

    The proxy samples from a fixed distribution, so its stream for steps 1..T is known in
    advance; each visited sequence is scored once, whatever the layout. The cache records the
    reference checkpoint's fingerprint (`doremi.methods.reference_cache.reference_stamp`): a reference
    trained again to the same path does not pass for the one scored."""
    opts, name = reference_options(cfg), reference_method(cfg)
    if opts.mode == "resample":
        raise ConfigError(f"mixing.{name}.mode: a reference cache needs a fixed proxy data stream; got 'resample'")
    out = Path(out_dir)
    check_out(out)  # only a reference cache is replaced
    ck = require_reference(cfg)
    ref_cfg = reference_config(cfg, ck)
    pc = init_parallel(cfg)
    feed = DataFeed(cfg.data, cfg.train.global_batch_size, cfg.train.micro_batches, pc, seed=cfg.data.seed)
    weights = resolve_weights(opts.proxy_sampling, feed.manifest, f"mixing.{name}.proxy_sampling", cfg.budget_tokens)
    visited = _visited_sequences(feed, weights, cfg.train.steps)
    stamp = reference_stamp(ck)
    facts = RunFacts.resolve(ref_cfg, pc)  # cfg's train and parallelism: its micro-batch size
    reference = OnlineReference(load_frozen(ref_cfg, ck, pc, facts), facts, pc)
    tmp = staging_dir(out)
    seq_len = cfg.data.seq_len
    if pc.is_main:
        create_arrays(tmp, feed.domains, [feed.train.num_sequences(d) for d in range(len(feed.domains))], seq_len)
    pc.barrier()
    _score_visited(reference, feed, visited, tmp, pc, facts.micro_batch_size)
    pc.barrier()
    if pc.is_main:
        publish(
            tmp,
            out,
            feed.domains,
            seq_len,
            stamp,
            cfg.train.steps,
            cfg.train.global_batch_size,
            cfg.data.seed,
            weights.tolist(),
            [len(v) for v in visited],
        )
    pc.barrier()
    return out


def _visited_sequences(feed: DataFeed, weights: Any, steps: int) -> list[set[int]]:
    """Per domain, the sequence indices the proxy's fixed stream draws in steps 1..`steps`."""
    visited: list[set[int]] = [set() for _ in feed.domains]
    for step in range(1, steps + 1):
        for d, i in feed.sampler.global_batch(step - 1, weights):
            visited[d].add(int(i))
    return visited


def _score_visited(
    reference: OnlineReference, feed: DataFeed, visited: list[set[int]], tmp: Path, pc: Any, mbs: int
) -> None:
    """Score each visited sequence once into the staged arrays; dp ranks split the chunks. The
    forward is the online reference's (`OnlineReference`), so a cached and an online proxy read
    the same losses. Rank 0 reports its chunks done on stderr (data/progress.py): at scale this
    is minutes."""
    total = sum(len(range(pc.dp_rank, -(-len(v) // mbs), pc.dp)) for v in visited)
    countdown = Countdown("score: batch", total) if pc.is_main else None
    done = 0
    for d, name in enumerate(feed.domains):
        idx = sorted(visited[d])
        chunks = [idx[j : j + mbs] for j in range(0, len(idx), mbs)]
        mine = chunks[pc.dp_rank :: pc.dp]
        # dp ranks may run different numbers of forwards: the collectives are inside tp/pp groups
        writer = pc.is_last_stage and pc.tp_rank == 0
        arr = open_for_scoring(tmp, name) if writer else None
        for chunk in mine:
            batch = collate(feed.train, [(d, i) for i in chunk], device=pc.device)
            reference(0, [batch])
            if writer:
                arr[chunk] = batch["ref_loss"].cpu().numpy()
            done += 1
            if countdown is not None:
                countdown.done(done, name)
        if arr is not None:
            arr.flush()
            del arr


def _run_method(mixing: dict[str, Any], stage: str | None) -> str | None:
    """The method whose weights a run logged: a proxy's `mixing.method`, an online main run's
    `mixing.main` (a proxy's config may name a main method it did not run); for a run without
    a record of its stage, the main method if any."""
    if stage == "proxy":
        return mixing.get("method")
    if stage == "train":
        return mixing.get("main")
    return mixing.get("main") or mixing.get("method")


def average(
    run_dir: str | Path, out: str | Path | None = None, from_step: int | None = None, allow_unfinished: bool = False
) -> Path:
    """Mean of the logged weights (DoReMi's alpha_t, or another method's) over the run's steps
    t >= from_step, written as the weights JSON with the method and its keys.

    `from_step` None: the proxy's own `mixing.<method>.average_from_step` (its config.yaml), so that
    `doremi average RUN` averages what the experiment asked for, not silently from step 1."""
    run = Path(run_dir)
    one = _run_average(run, from_step, allow_unfinished)
    out_path = Path(out) if out else run / WEIGHTS_FILE
    write_weights_file(out_path, one.domains, one.weights, one.provenance, sources=one.sources, notes=one.notes)
    return out_path


def average_runs(
    run_dirs: list[str | Path], out: str | Path, from_step: int | None = None, allow_unfinished: bool = False
) -> Path:
    """The mean over several proxies (seeds of one search) of each one's averaged weights
    (`average`), written to `out` with every run as a source.

    One proxy's averaged weights carry its seed's noise: the DoReMi study measured searched
    weights that differ by seed enough to dominate the main runs' differences (docs/design.md
    section 4e). Pooling k searches is the average DoReMi already takes over a proxy's steps
    (Xie et al. 2023, Algorithm 1 returns the mean of alpha_t), taken over independent runs as
    well; its cost is k searches, and a study's ledger charges all of them to the pooled arm."""
    if len(run_dirs) < 2:
        return average(run_dirs[0], out, from_step, allow_unfinished)
    seen: dict[Path, str | Path] = {}
    for r in run_dirs:
        if Path(r).resolve() in seen:
            raise DoReMiError(f"{r}: given twice (as {seen[Path(r).resolve()]}); pool each run once")
        seen[Path(r).resolve()] = r
    runs = [_run_average(Path(r), from_step, allow_unfinished) for r in run_dirs]
    first = runs[0]
    for r in runs[1:]:
        if r.domains != first.domains:
            raise DoReMiError(
                f"{r.provenance['source']}: domains {', '.join(r.domains)} differ from "
                f"{first.provenance['source']}'s ({', '.join(first.domains)}); pool runs of one corpus"
            )
        if r.provenance["method"] != first.provenance["method"]:
            raise DoReMiError(
                f"{r.provenance['source']}: method {r.provenance['method']} differs from "
                f"{first.provenance['source']}'s ({first.provenance['method']}); pool runs of one method"
            )
    weights = np.mean([r.weights for r in runs], axis=0)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    provenance: dict[str, Any] = {
        "source": [r.provenance["source"] for r in runs],
        "method": first.provenance["method"],
        "pooled_runs": len(runs),
        "per_run": [{k: v for k, v in r.provenance.items() if k != "method"} for r in runs],
    }
    write_weights_file(
        Path(out),
        first.domains,
        weights / weights.sum(),
        provenance,
        sources=[s for r in runs for s in r.sources],
        notes=[n for r in runs for n in r.notes],
    )
    return Path(out)


@dataclasses.dataclass(frozen=True)
class _Averaged:
    """One run's averaged weights and what its weights file records of it."""

    domains: list[str]
    weights: np.ndarray
    provenance: dict[str, Any]
    sources: list[artifact.Source]
    notes: list[str]


def _run_average(run: Path, from_step: int | None, allow_unfinished: bool) -> _Averaged:
    made_from = require_finished(  # a proxy killed at step 61 of 300 is refused
        run, "proxy", allow=allow_unfinished, hint="; `doremi average --allow-unfinished` averages it anyway"
    )
    history = read_history(run)
    if not history:
        raise DoReMiError(f"{run}/domain_weights.jsonl: no weight history (is this a proxy run?)")
    cfg_path = run / "config.yaml"
    if made_from is not None and not cfg_path.is_file():  # a run with a header wrote its config
        raise DoReMiError(
            f"{cfg_path}: missing; the proxy's config names its method and mixing.<method>.average_from_step "
            f"(averaged without it, the weights would be recorded as another method's, from step 1)"
        )
    saved = read_yaml(cfg_path) if cfg_path.is_file() else {}
    mixing = saved.get("mixing") if isinstance(saved.get("mixing"), dict) else {}
    method = _run_method(mixing, recorded_stage(run)) or METHODS[0]
    options = registry_options(saved, method)
    where = "--from-step"
    if from_step is None:
        from_step, where = options.get("average_from_step", 1), f"{cfg_path}: mixing.{method}.average_from_step"
    if isinstance(from_step, bool) or not isinstance(from_step, int) or from_step < 1:
        raise DoReMiError(f"{where}: expected an int >= 1, got {from_step!r}")
    weights = average_weights(history, from_step=from_step)
    steps = [h["step"] for h in history if h["step"] >= from_step]
    provenance: dict[str, Any] = {
        "source": str(run),
        "method": method,
        "from_step": from_step,
        "steps_averaged": len(steps),
        "last_step": steps[-1] if steps else None,
    }
    keys = (spec(method).average_keys if method in specs() else ()) or tuple(options)
    provenance.update({k: options.get(k) for k in keys})
    sources, notes = [], []
    if made_from is not None:
        sources = [artifact.Source("run", str(run), made_from.fingerprint)]
        if made_from.status != "finished":
            notes = [f"--allow-unfinished: averaged a run that did not finish ({made_from.describe()})"]
    return _Averaged(list(history[0]["domains"]), np.asarray(weights, dtype=np.float64), provenance, sources, notes)


def evaluate(checkpoint: str | Path, overrides: list[str] | None = None) -> tuple[list[str], np.ndarray]:
    """Per-domain validation loss of a checkpoint (its run's config, any layout via --set): the
    verdict's, on the test half under `data.validation_split: dev_test`."""
    ck = resolve_checkpoint(checkpoint)
    saved = run_dir_of(ck) / "config.yaml"
    if not saved.is_file():
        raise DoReMiError(f"{saved}: the checkpoint's run config is missing")
    raw_overrides = ["checkpoint.resume=false", *(overrides or [])]
    cfg = load_saved_config(saved, raw_overrides)
    pc = init_parallel(cfg)
    facts = RunFacts.resolve(cfg, pc)
    model = load_frozen(cfg, ck, pc, facts)  # first: a run on rebuilt stores is named as such
    feed = DataFeed(cfg.data, cfg.train.global_batch_size, cfg.train.micro_batches, pc, seed=cfg.data.seed)
    losses = evaluate_domains(
        model, feed.validation(facts.micro_batch_size, cfg.train.eval_sequences, "verdict"), pc, facts.autocast()
    )
    return feed.domains, losses.cpu().numpy()
