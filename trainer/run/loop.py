"""The training loop: data -> mixing hook -> forward/backward schedule -> sync -> clip ->
update -> metrics, eval and checkpoints. Knows nothing of data mixing beyond `MixingHook`."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data.sampling.mixtures import sequence_capped
from data.sampling.weights import resolve_weights
from data.store.batch import IGNORE_INDEX
from data.store.validation_split import STAGE_EVALUATION, check_method_split
from trainer.build import RunFacts, build_model, init_parallel, seed_everything
from trainer.checkpoint.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from trainer.config.schema import TrainerConfig, auto_notes
from trainer.config.tools import ConfigError, dump_yaml, to_dict
from trainer.feed.data_feed import DataFeed
from trainer.hf.init import init_from_hf
from trainer.model.flops import flops_per_token
from trainer.model.fp8 import amax_histories, end_fp8_step, load_amax_histories
from trainer.model.moe import moe_metrics
from trainer.optim.build import build_optimizer
from trainer.parallel.context import ParallelContext
from trainer.parallel.tensor import sync_sequence_parallel_grads
from trainer.parallel.tied import sync_tied_grads
from trainer.records import run_dir as rundir
from trainer.records.eval_sequences import write_sequence_losses
from trainer.records.metrics import MetricsLogger, read_jsonl
from trainer.records.pairing import first_batch_by_domain, rank_digests, write_pairing
from trainer.records.run_report import cpu_build_note, decision_line, say, startup_line, summary_lines
from trainer.run.alignment import aligned_step
from trainer.run.determinism import set_deterministic
from trainer.run.device_timer import DeviceTimer
from trainer.run.evaluate import evaluate_domains, evaluate_domains_with_error, evaluate_sequences, sequence_means
from trainer.run.health import NumericHealth
from trainer.run.hooks import FixedMixture, MethodContext, MethodFactory, MixingHook, StepSignals
from trainer.run.interrupt import Interrupted, StopRequests
from trainer.run.schedule_extension import Extension, plan_extension, scheduled_lr
from trainer.run.signals import MethodWeighting
from trainer.run.step import StepStats, domain_token_counts, forward_backward

#: bf16 dense peak of an H100/H200 from the datasheet, for MFU.
DATASHEET_PEAK_FLOPS = 989e12


class Trainer:
    def __init__(
        self,
        cfg: TrainerConfig,
        pc: ParallelContext | None = None,
        run_dir: str | None = None,
        desc: str = "train",
        result_ignore: tuple[str, ...] = (),
        stage: str = "train",
        method: MethodFactory | None = None,
        evaluation: str | None = None,
    ):
        """`result_ignore`: config sections or keys this run does not read (`doremi` for a plain
        training run), left out of the fingerprint that a resume must match. `stage` (train,
        reference, proxy) is recorded in `run.json`: another stage refuses the directory.
        `method`: the data-mixing method (`trainer.run.hooks`); None trains on `data.domain_weights`.
        `evaluation`: the consumer of this run's own evaluation (data.store.validation_split.CONSUMERS;
        None: the stage's, `verdict` for a main run), which picks its validation documents."""
        self.cfg = cfg
        self.auto_notes = auto_notes(cfg)  # before the config is replaced below, which drops them
        if not (run_dir or cfg.train.run_dir):
            raise ConfigError("train.run_dir: required (the directory this run writes), got nothing")
        self.run_dir = Path(run_dir or cfg.train.run_dir)
        self.desc = desc
        self.stage = stage
        self.eval_consumer = evaluation or STAGE_EVALUATION[stage]
        self.extension: Extension | None = None
        self.result_ignore = result_ignore
        self.record: dict[str, Any] = {}
        set_deterministic(cfg.train.deterministic)  # before the first CUDA kernel
        self.pc = pc or init_parallel(cfg)
        seed_everything(cfg.train.seed)
        self.feed = DataFeed(
            cfg.data, cfg.train.global_batch_size, cfg.train.micro_batches, self.pc, seed=cfg.data.seed
        )
        self.feed.check_vocab(cfg.model.vocab_size)
        self.hook: MixingHook = FixedMixture(self._fixed_weights()) if method is None else method(self.method_context())
        self.feed.check_allowance(cfg.train.steps)
        check_method_split(self.hook.needs.validation_split, type(self.hook).__name__)
        if self.hook.needs.stats_before_backward and cfg.parallelism.pp_schedule != "afab":
            # The weights need every forward of the step before any backward; the stage split
            # then counts the in-flight batches of that schedule.
            cfg = self.cfg = dataclasses.replace(
                cfg, parallelism=dataclasses.replace(cfg.parallelism, pp_schedule="afab")
            )
        self.facts = RunFacts.resolve(cfg, self.pc)
        self.model = build_model(cfg, self.pc, self.facts)
        init_from_hf(self.model, cfg, self.pc, self.run_dir)  # model.init_from_hf, before the optimizer
        self.named_params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.optimizer = build_optimizer(
            self.named_params, cfg.train, self.pc, cfg.parallelism.zero1, param_dtype=self.facts.param_dtype
        )
        self._init_step_state(cfg)
        self.feed.validation(self.facts.micro_batch_size, cfg.train.eval_sequences, self.eval_consumer)  # fail now

    def _init_step_state(self, cfg: TrainerConfig) -> None:
        """What the loop keeps from step to step, before step 0: counters, the last row, the
        realised tokens and the numeric-health tracker."""
        self.step = 0
        self._init_digests: list[str] | None = None  # a fresh run's initial parameters (trainer/records/pairing.py)
        #: Validation passes a method asked for since step 0: passes, tokens, seconds.
        self.method_evals: dict[str, float] = {"passes": 0, "tokens": 0, "seconds": 0.0}
        self.last: dict[str, Any] = {}  # the last logged row, merged with the last evaluation
        # Non-masked label tokens drawn per domain since step 1 (on the device: no host sync per step).
        self.realised_tokens = torch.zeros(self.feed.k, dtype=torch.float64, device=self.pc.device)
        self.health = NumericHealth(self.pc.device)
        self.autocast = self.facts.autocast()
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        self.delayed_fp8 = cfg.model.fp8 is not None and cfg.model.fp8.amax_history > 0

    def method_context(self) -> MethodContext:
        cfg = self.cfg
        return MethodContext(
            domains=list(self.feed.domains),
            run_dir=self.run_dir,
            is_main=self.pc.is_main,
            device=self.pc.device,
            seed=cfg.data.seed,
            steps=cfg.train.steps,
            global_batch_size=cfg.train.global_batch_size,
            seq_len=cfg.data.seq_len,
            train_tokens=[int(d.train.tokens) for d in self.feed.manifest.domains],
            pc=self.pc,
        )

    # -- state ---------------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "data": self.feed.state_dict(),
            "method": self.hook.state_dict(),
            "realised_tokens": self.realised_tokens.tolist(),
            "method_evals": dict(self.method_evals),
            "run": self.record,
            "config": to_dict(self.cfg),
            "lr_extension": None if self.extension is None else self.extension.state_dict(),
            "fp8": amax_histories(self.model, self.pc) if self.delayed_fp8 else {},
        }

    def save(self) -> None:
        self.hook.flush()  # the method's log holds every step the checkpoint does
        save_checkpoint(
            self.run_dir,
            self.step,
            self.model,
            self.optimizer,
            self.pc,
            self.extra_state(),
            keep=self.cfg.checkpoint.keep,
            data=self.feed.manifest.identity(),
        )

    def maybe_resume(self) -> bool:
        ck = self.cfg.checkpoint
        path = latest_checkpoint(self.run_dir) if ck.resume else None
        own = path is not None
        if path is None and ck.load:
            path = Path(ck.load)
        if path is None:
            return False
        # A resume must read the stores it trained on; a checkpoint loaded to start from may not.
        data = self.feed.manifest.identity() if own else None
        extra = load_checkpoint(path, self.model, self.optimizer, self.pc, data=data)
        saved, current = extra.get("run") if own else None, self.record
        if own:
            saved_steps = int(extra.get("config", {}).get("train", {}).get("steps", extra["step"]))
            before = Extension.from_state(extra.get("lr_extension"))
            self.extension = plan_extension(self.run_dir, int(extra["step"]), saved_steps, self.cfg.train, before)
            if self.extension is not None and self.extension != before and saved is not None:
                saved, current = rundir.without(saved, "train.steps"), rundir.without(current, "train.steps")
        rundir.check_resume(
            self.run_dir if own else path,
            saved,
            current,
            int(extra["step"]),
            self.cfg.train.steps,
            ck.resume_changed,
        )
        self.step = int(extra["step"])
        self.feed.load_state_dict(extra["data"])
        if len(extra.get("realised_tokens", [])) != self.feed.k:
            raise ConfigError(
                f"checkpoint {path}: no realised token counts for {self.feed.k} domains "
                f"(written by an older version); start the run again"
            )
        self.realised_tokens = torch.tensor(extra["realised_tokens"], dtype=torch.float64, device=self.pc.device)
        self.hook.load_state_dict(extra.get("method", extra.get("hook", {})))
        self.method_evals = {**self.method_evals, **extra.get("method_evals", {})}
        if own and self.delayed_fp8:
            load_amax_histories(self.model, extra.get("fp8", {}), self.pc.device, str(path))
        return True

    # -- one step ------------------------------------------------------------------------
    def train_step(self) -> tuple[StepStats, dict[str, Any]]:
        self.step += 1
        step, pc, hook, k = self.step, self.pc, self.hook, self.feed.k
        weights = hook.sampling_weights(step)
        batches = self.feed.step_batches(step, weights, hook.needs.draws)
        self._announce_exhausted(step)
        hook.prepare_batches(step, batches)
        domain_tokens = domain_token_counts(batches, k, pc)
        self.realised_tokens += domain_tokens
        signals = StepSignals(
            weights=self.feed.drawn_weights(weights),
            sequences=np.array(self.feed.sampler.counts),
            tokens=domain_tokens,
            lr=self.lr(step),
        )
        if hook.needs.alignment is not None:
            with self.autocast:
                stats = aligned_step(
                    self.model, self.named_params, batches, signals, step, hook, self.feed, pc, self.optimizer
                )
        else:
            weighting = MethodWeighting(hook, step, signals, pc, k)
            schedule = "afab" if weighting.needs_forward_losses else self.cfg.parallelism.pp_schedule
            with self.autocast:
                stats = forward_backward(self.model, batches, weighting, pc, schedule, k)
            weighting.finish(stats.local_losses, batches)
            sync_sequence_parallel_grads(self.model, pc)
            sync_tied_grads(self.model, pc)
        signals.loss_sum = stats.domain_loss_sum
        if hook.needs.host_signals:
            signals.copy_to_host()
        self.optimizer.reduce_gradients()
        stats.grad_norm = self.optimizer.clip_grad_norm(self.cfg.train.grad_clip)
        self.health.observe(step, stats.loss, stats.grad_norm)
        self.optimizer.step(self.lr(step))
        self.optimizer.zero_grad()
        end_fp8_step(self.model, pc)
        extra = hook.after_step(step, signals)
        if hook.needs.validation:
            if hook.validation_due(step):
                self.method_validation(step)
            extra["method_evals"] = dict(self.method_evals)
        return stats, extra

    def method_validation(self, step: int) -> None:
        """The method's validation losses at `step`, counted with the seconds they took on the
        device (the cost of the method's signal, apart from the training step's; `DeviceTimer`:
        a host clock would also count the training work still queued when the pass began)."""
        n = self.hook.needs.validation_sequences
        sequences = self.cfg.train.eval_sequences if n is None else n
        with DeviceTimer(self.pc.device) as timer:
            batches = self.feed.validation(self.facts.micro_batch_size, sequences, "method_probe")
            self.hook.observe_validation(step, evaluate_domains(self.model, batches, self.pc, self.autocast))
        self.method_evals["passes"] += 1
        self.method_evals["tokens"] += sum(int((b["labels"] != IGNORE_INDEX).sum()) for d in batches for b in d)
        self.method_evals["seconds"] += timer.seconds()

    def _announce_exhausted(self, step: int) -> None:
        """One line (rank 0) for each domain the step just drawn read to `data.max_epochs`: from
        here the sampler hands its share to the others (data/sampling/sampler.py)."""
        sampler = self.feed.sampler
        lines = [
            f"data.max_epochs {self.feed.max_epochs:g}: domain {self.feed.domains[d]!r} read "
            f"{sampler.epochs()[d]:.4g} epochs of its pool ({sampler.cursors[d]} sequences) at step {step}; "
            f"the other domains take its share"
            for d in sampler.newly_exhausted
        ]
        say(lines, self.facts.is_main)

    def _fixed_weights(self) -> np.ndarray:
        """`data.domain_weights` as the run reads them: capped at `data.max_epochs` ahead of the
        run, with a line naming each domain the cap moved (rank 0). The sampler's own caps, which
        every run has under `data.max_epochs`, then never bind (`sequence_capped` keeps the exact
        sampler's slack of one sequence)."""
        d, manifest = self.cfg.data, self.feed.manifest
        given = resolve_weights(d.domain_weights, manifest, "data.domain_weights", self.cfg.budget_tokens)
        if d.max_epochs is None:
            return given
        sequences = self.cfg.train.steps * self.cfg.train.global_batch_size
        read = sequence_capped(given, self.feed.sampler.num_sequences, sequences, d.max_epochs)
        moved = [f"{n} {a:.4f} -> {b:.4f}" for n, a, b in zip(manifest.domain_names, given, read) if a != b]
        if moved:
            say([f"data.max_epochs {d.max_epochs:g}: the mixture is capped: " + ", ".join(moved)], self.pc.rank == 0)
        return read

    def lr(self, step: int) -> float:
        return scheduled_lr(step, self.cfg.train, self.extension)

    def evaluate(self, step: int | None = None, final: bool = False) -> np.ndarray:
        """Per-domain validation loss of this run's own evaluation. With
        `train.eval_sequence_losses`, from each sequence's loss sum, written (rank 0) to
        `eval_sequences/step_NNNNNNN.npz` at the final evaluation (`final`) or at every one."""
        t = self.cfg.train
        batches = self.feed.validation(self.facts.micro_batch_size, t.eval_sequences, self.eval_consumer)
        if t.eval_sequence_losses == "off":
            return evaluate_domains(self.model, batches, self.pc, self.autocast).cpu().numpy()
        per_sequence = evaluate_sequences(self.model, batches, self.pc, self.autocast)
        if self.facts.is_main and step is not None and (final or t.eval_sequence_losses == "every"):
            documents = self.feed.validation_documents(t.eval_sequences, self.eval_consumer)
            half = self.feed.validation_half(self.eval_consumer)
            write_sequence_losses(self.run_dir, step, self.feed.domains, half, per_sequence, documents)
        return sequence_means(per_sequence)

    def evaluate_memorisation(self) -> tuple[np.ndarray, ...]:
        """(loss on sequences this run trained on, its standard error, loss on held-back
        training sequences, its standard error) per domain, as many sequences of each as
        `data.holdout_sequences`: the gap is memorisation, not a shift between the train and
        validation splits, measured to within the two standard errors."""
        mb = self.facts.micro_batch_size
        seen = evaluate_domains_with_error(self.model, self.feed.seen_batches(mb), self.pc, self.autocast)
        held = evaluate_domains_with_error(self.model, self.feed.heldout_batches(mb), self.pc, self.autocast)
        return tuple(t.cpu().numpy() for t in (*seen, *held))

    # -- the loop ------------------------------------------------------------------------
    @contextlib.contextmanager
    def owning_run_dir(self) -> Iterator[None]:
        """Rank 0 holds the run directory's lock for the job's life and applies the policy for
        what is already there; every rank gets its verdict, so that all stop or none."""
        with contextlib.ExitStack() as stack:

            def own() -> None:
                rundir.check_owned(self.run_dir)  # before its lock file, temp-file removal or start_over
                stack.enter_context(rundir.locked(self.run_dir))
                self._prepare_run_dir()

            rundir.on_rank0(own, self.facts.is_main)
            yield

    def _prepare_run_dir(self) -> None:
        ck = self.cfg.checkpoint
        for stale in self.run_dir.glob(".*.tmp"):  # atomic writes cut short by a kill
            if stale.is_file():
                stale.unlink()
        if ck.start_over:
            moved = rundir.move_aside(self.run_dir)
            if moved is not None:
                print(
                    f"{self.run_dir}: checkpoint.start_over: the previous run was moved to {moved}",
                    file=sys.stderr,
                    flush=True,
                )
            return
        rundir.check_stage(self.run_dir, self.stage)
        rundir.check_incomplete(self.run_dir)
        latest = latest_checkpoint(self.run_dir)
        rundir.check_fresh_start(
            self.run_dir, None if latest is None else int(latest.name.removeprefix("step_")), ck.resume, ck.start_over
        )

    def fit(self) -> dict[str, Any]:
        with self.owning_run_dir():
            return self._fit()

    def _fit(self) -> dict[str, Any]:
        cfg, pc = self.cfg, self.pc
        self.record = {**rundir.record(cfg, self.result_ignore), "stage": self.stage}
        resumed = self.maybe_resume()
        start = [
            decision_line(self.run_dir, self.step, cfg.train.steps),
            startup_line(cfg, self.facts, pc, self.auto_notes),
        ]
        start += [note] if (note := cpu_build_note(self.facts.device)) else []
        say(start, self.facts.is_main)
        if self.facts.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            dump_yaml(cfg, self.run_dir / "config.yaml")
            made_from = rundir.sources(cfg)
            rundir.write_record(self.run_dir, self.record, "running", self.step, cfg.train.steps, made_from)
        log = MetricsLogger(
            self.run_dir,
            self.facts.is_main,
            cfg.train.steps,
            self.step,
            cfg.logging.progress,
            cfg.logging.wandb,
            cfg.logging.wandb_project,
            cfg.logging.run_name,
            config=to_dict(cfg),
            resume=resumed,
            desc=self.desc,
            group=cfg.logging.wandb_group,
            tensorboard=cfg.logging.tensorboard,
        )
        if pc.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pc.device)
        if not resumed and self.hook.needs.validation and self.hook.validation_due(0):
            self.method_validation(0)
        self._init_digests = None if resumed else rank_digests(self.model)
        stops = StopRequests(announce=self.facts.is_main, every=cfg.logging.every if pc.distributed else 1)
        try:
            with stops.installed():
                self._loop(log, stops)
        except Interrupted:
            if self.facts.is_main:
                rundir.mark(self.run_dir, "interrupted", self.step)
            raise
        finally:
            log.close()
            self.hook.close()
        if self.facts.is_main:
            rundir.mark(self.run_dir, "finished", self.step)
        if self.facts.is_main:
            say(summary_lines(self.run_dir, self.step, self.final_rows()), True, sys.stdout)
        return self.last

    def final_rows(self) -> dict[str, Any]:
        """The last train row and the last evaluation of `metrics.jsonl`, merged (rank 0)."""
        rows = read_jsonl(self.run_dir / "metrics.jsonl")
        train = next((r for r in reversed(rows) if "loss" in r), {})
        val = next((r for r in reversed(rows) if "val_loss" in r), {})
        return {**train, **val}

    def _loop(self, log: MetricsLogger, stops: StopRequests) -> None:
        cfg, pc = self.cfg, self.pc
        last: dict[str, Any] = {}
        tokens_since, t0 = 0.0, time.perf_counter()
        while self.step < cfg.train.steps:
            stats, extra = self.train_step()
            step = self.step
            if step == 1 and self._init_digests is not None and self.facts.is_main:
                first = first_batch_by_domain(self.feed.sampler.last_batch, list(self.feed.domains))
                write_pairing(self.run_dir, self._init_digests, first, cfg.train.seed, cfg.data.seed)
            tokens_since += cfg.train.global_batch_size * cfg.data.seq_len
            is_last = step == cfg.train.steps
            # Where the loop reads the device anyway, and before any checkpoint (trainer/run/health.py).
            cadences = (cfg.logging.every, cfg.train.eval_every, cfg.checkpoint.every)
            if is_last or any(n and step % n == 0 for n in cadences):
                self.health.check(str(self.run_dir))
            if step % cfg.logging.every == 0 or is_last:
                if pc.device.type == "cuda":
                    torch.cuda.synchronize(pc.device)
                dt = time.perf_counter() - t0
                self.hook.flush()
                row = self._row(step, stats, tokens_since / dt, extra)
                tokens_since, t0 = 0.0, time.perf_counter()
                log.log(row)
                log.progress(step, loss=row["loss"], tok_s=int(row["tokens_per_s"]))
                last = row
            if is_last or (cfg.train.eval_every and step % cfg.train.eval_every == 0):  # 0: only at the end
                t_eval = time.perf_counter()
                val = self.evaluate(step, is_last)
                vrow = self._val_row(step, val)
                if self.feed.holdout and is_last:
                    seen, seen_se, held, held_se = self.evaluate_memorisation()
                    vrow["seen_loss"] = self._by_domain(seen)
                    vrow["heldout_loss"] = self._by_domain(held)
                    vrow["seen_loss_se"] = self._by_domain(seen_se)
                    vrow["heldout_loss_se"] = self._by_domain(held_se)
                # wall seconds of this evaluation (its losses are on the host: the device is done)
                vrow["eval_seconds"] = time.perf_counter() - t_eval
                log.log(vrow)
                last = {**last, **vrow}
                tokens_since, t0 = 0.0, time.perf_counter()
            saved = cfg.checkpoint.every and step % cfg.checkpoint.every == 0 or is_last
            if saved:
                self.save()
                tokens_since, t0 = 0.0, time.perf_counter()
            # One process acts on a signal at the next step; ranks agree on one at logging steps,
            # where the loop reads the device anyway: no extra host sync in the steps between.
            signum = 0 if is_last or step % stops.every else stops.agreed(pc)
            if signum:
                if not saved:
                    self.health.check(str(self.run_dir))
                    self.save()
                raise Interrupted(signum, step, str(self.run_dir))
        self.last = last

    def _row(self, step: int, stats: StepStats, tokens_per_s: float, extra: dict[str, Any]) -> dict[str, Any]:
        exhausted = self.feed.exhausted()  # the step each domain was read to data.max_epochs
        row: dict[str, Any] = {
            "step": step,
            "loss": float(stats.loss),
            "lr": self.lr(step),
            "grad_norm": float(stats.grad_norm) if stats.grad_norm is not None else None,
            "tokens": step * self.cfg.train.global_batch_size * self.cfg.data.seq_len,
            "tokens_per_s": tokens_per_s,
            "domain_loss": dict(zip(self.feed.domains, stats.domain_loss.tolist())),
            "epochs": dict(zip(self.feed.domains, self.feed.sampler.epochs())),
            **({} if exhausted is None else {"exhausted": exhausted}),
            "realised": {
                "sequences": dict(zip(self.feed.domains, self.feed.sampler.drawn())),
                "tokens": dict(zip(self.feed.domains, (int(x) for x in self.realised_tokens.tolist()))),
                "nominal_sequences": dict(zip(self.feed.domains, self.feed.sampler.nominal)),
                "draws": self.hook.needs.draws,
            },
        }
        if self.pc.device.type == "cuda":
            achieved = tokens_per_s * self.flops_per_token / self.pc.world_size
            row["mfu"] = achieved / DATASHEET_PEAK_FLOPS
            row["peak_memory_gb"] = torch.cuda.max_memory_allocated(self.pc.device) / 2**30
        row.update(moe_metrics(self.model, self.cfg.model, self.pc))
        domains = self.feed.domains
        row.update({k: dict(zip(domains, v.tolist())) if isinstance(v, torch.Tensor) else v for k, v in extra.items()})
        return row

    def _by_domain(self, values: np.ndarray) -> dict[str, float | None]:
        return {d: None if np.isnan(v) else float(v) for d, v in zip(self.feed.domains, values)}

    def _val_row(self, step: int, val: np.ndarray) -> dict[str, Any]:
        return {
            "step": step,
            "val_loss": dict(zip(self.feed.domains, val.tolist())),
            "val_avg": float(np.mean(val)),
            "val_worst": float(np.max(val)),
            "eval_tokens": self.feed.validation_tokens(self.cfg.train.eval_sequences, self.eval_consumer),
        }
