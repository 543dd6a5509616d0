"""A run's lifecycle and what it says: its own directory per stage, the start and summary lines,
plain progress lines in a log, checkpoints on SIGINT/SIGTERM, extending a finished run, wandb's
name, group, config and mixing signals, and errors printed once under torchrun."""

from __future__ import annotations

import json
import re
import signal
import sys
import types
from pathlib import Path

import pytest

from doremi.commands import cli
from doremi.pipeline import stages
from tests.runs import STORE_YAML, config, losses
from trainer.checkpoint.checkpoint import latest_checkpoint
from trainer.config.schema import CheckpointConfig, TrainConfig
from trainer.config.tools import ConfigError
from trainer.model.flops import param_count
from trainer.records.metrics import read_jsonl
from trainer.run.loop import Trainer


def lrs(run: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r}


# -- run directories -------------------------------------------------------------------------


def test_default_run_dir_per_stage_and_config():
    assert TrainConfig().run_dir is None
    assert stages.default_run_dir("experiments/configs/quickstart.yaml", "train") == "runs/quickstart/train"
    assert stages.default_run_dir("a/quickstart.yaml", "train-proxy") == "runs/quickstart/proxy"
    assert stages.default_run_dir("a/quickstart.yaml", "train-reference") == "runs/quickstart/reference"
    assert stages.default_run_dir("a/other.yaml", "train") == "runs/other/train"


def test_cli_stage_without_run_dir_writes_its_own(stores, tmp_path, monkeypatch):
    cfg = tmp_path / "exp.yaml"
    cfg.write_text(STORE_YAML.format(store=stores, run="RUN").replace("run_dir: RUN,", ""))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", str(cfg), "--set", "train.steps=2"]) == 0
    assert latest_checkpoint(tmp_path / "runs/exp/train").name == "step_0000002"
    assert json.loads((tmp_path / "runs/exp/train/run.json").read_text())["stage"] == "train"


def test_another_stage_refuses_the_directory(stores, tmp_path):
    run = tmp_path / "run"
    stages.train(config(stores, run, "train.steps=2"))
    with pytest.raises(ConfigError, match=r"run: holds a train run, not a reference run; give this stage its own"):
        stages.train(config(stores, run, "train.steps=2"), stage="reference")
    assert len(losses(run)) == 2


# -- what a run says ---------------------------------------------------------------------------


def test_start_decision_startup_and_summary_lines(stores, tmp_path, capsys):
    run = tmp_path / "run"
    sets = ["train.decay=constant", "train.eval_every=2"]
    stages.train(config(stores, run, "train.steps=2", *sets))
    out, err = capsys.readouterr()
    cfg = config(stores, run)
    assert err.splitlines()[0] == f"new run in {run} (2 steps)"
    assert err.splitlines()[1] == (
        "device cpu, compute fp32, param dtype float32, layout tp1 x pp1 x dp1, global batch 8 = "
        f"1 micro-batch(es) of 8 x dp1, {param_count(cfg.model) / 1e6:.2f}M parameters"
    )
    val = next(r for r in read_jsonl(run / "metrics.jsonl") if "val_loss" in r)["val_loss"]
    assert out.splitlines() == [
        f"run directory {run}: step 2",
        f"final train loss {losses(run)[-1]:.4f}",
        "final validation loss: " + ", ".join(f"{d} {v:.4f}" for d, v in val.items()),
    ]

    stages.train(config(stores, run, "train.steps=3", *sets))
    assert capsys.readouterr().err.splitlines()[0] == f"resuming {run} from step 2 of 3"
    stages.train(config(stores, run, "train.steps=3", *sets))
    out, err = capsys.readouterr()
    assert err.splitlines()[0] == f"nothing to do: {run} finished at step 3"
    assert out.splitlines()[:2] == [f"run directory {run}: step 3", f"final train loss {losses(run)[-1]:.4f}"]
    assert len(losses(run)) == 3


@pytest.mark.parametrize("progress", ["true", "false"])
def test_plain_progress_lines_when_stderr_is_not_a_terminal(stores, tmp_path, capsys, progress):
    run = tmp_path / "run"
    stages.train(config(stores, run, f"logging.progress={progress}", "logging.every=2", "train.steps=3"))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("train step ")]
    loss = losses(run)
    assert [line.split(" tok_s ")[0] for line in lines] == [
        f"train step 2/3 loss {loss[0]:.4g}",
        f"train step 3/3 loss {loss[1]:.4g}",
    ]


# -- checkpoints: the default cadence and signals -----------------------------------------------


def test_periodic_checkpoints_by_default():
    assert CheckpointConfig().every == 1000


@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_saves_at_the_step_boundary_and_the_same_command_resumes(
    stores, tmp_path, monkeypatch, capsys, signum, status
):
    whole = tmp_path / "whole"
    stages.train(config(stores, whole, "train.steps=4"))
    run = tmp_path / "run"
    path = tmp_path / "run.yaml"
    config(stores, run)  # writes run.yaml
    step = Trainer.train_step

    def signalled(self):
        out = step(self)
        if self.step == 2:
            signal.raise_signal(signum)
        return out

    monkeypatch.setattr(Trainer, "train_step", signalled)
    before = signal.getsignal(signum)
    capsys.readouterr()
    assert cli.main(["train", str(path), "--set", "train.steps=4"]) == status
    name = signal.Signals(signum).name
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"doremi train: {name}: saved {run} at step 2; the same command resumes"
    )
    assert latest_checkpoint(run).name == "step_0000002"
    assert signal.getsignal(signum) == before  # the handler is the run's only

    monkeypatch.setattr(Trainer, "train_step", step)
    assert cli.main(["train", str(path), "--set", "train.steps=4"]) == 0
    assert capsys.readouterr().err.splitlines()[0] == f"resuming {run} from step 2 of 4"
    assert losses(run) == losses(whole)


# -- extending a finished run --------------------------------------------------------------------


def test_extending_a_finished_run_is_refused_unless_chosen(stores, tmp_path):
    run = tmp_path / "run"
    stages.train(config(stores, run, "train.steps=3"))  # cosine, warmup 1, lr 3e-3 -> min_lr 1e-4
    assert lrs(run)[3] == pytest.approx(1e-4, rel=1e-12)
    with pytest.raises(ConfigError) as e:
        stages.train(config(stores, run, "train.steps=5"))
    assert str(e.value) == (
        f"{run}: the run finished at step 3; continuing to train.steps=5 would re-stretch the "
        "learning-rate schedule (lr 0.0001 at step 3, 0.000525 at step 4); set train.extend: "
        "continue_at_min_lr or restart_schedule, or use another run directory"
    )
    assert latest_checkpoint(run).name == "step_0000003"

    stages.train(config(stores, run, "train.steps=5", "train.extend=continue_at_min_lr"))
    assert [lrs(run)[s] for s in (4, 5)] == pytest.approx([1e-4, 1e-4], rel=1e-12)


def test_restart_schedule_warms_up_and_decays_over_the_added_steps(stores, tmp_path):
    run = tmp_path / "run"
    stages.train(config(stores, run, "train.steps=3"))
    stages.train(config(stores, run, "train.steps=5", "train.extend=restart_schedule", "checkpoint.every=1"))
    # the added steps 4, 5 are steps 1, 2 of a 2-step schedule: warmup to 3e-3, then min_lr
    assert [lrs(run)[s] for s in (4, 5)] == pytest.approx([3e-3, 1e-4], rel=1e-12)


# -- wandb ----------------------------------------------------------------------------------------


class FakeWandb(types.ModuleType):
    """Records `wandb.init` kwargs and logged rows."""

    def __init__(self):
        super().__init__("wandb")
        self.inits: list[dict] = []
        self.rows: list[tuple[dict, int]] = []
        self.Settings = dict

    def init(self, **kwargs):
        self.inits.append(kwargs)
        rows = self.rows
        return types.SimpleNamespace(log=lambda row, step: rows.append((row, step)), finish=lambda: None)


@pytest.fixture
def fake_wandb(monkeypatch) -> FakeWandb:
    wb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wb)
    return wb


def test_wandb_name_group_and_config(stores, tmp_path, fake_wandb):
    run = tmp_path / "run"
    stages.train(config(stores, run, "train.steps=2", "logging.wandb=true", "logging.wandb_group=g1"))
    (init,) = fake_wandb.inits
    assert init["name"] == f"train:{run}"
    assert init["group"] == "g1"
    assert init["config"]["train"]["steps"] == 2 and init["config"]["train"]["run_dir"] == str(run)
    assert [step for _, step in fake_wandb.rows] == [1, 2, 2]  # train rows, then the final evaluation
    assert fake_wandb.rows[1][0]["loss"] == losses(run)[1]
    assert fake_wandb.rows[1][0]["realised/tokens/noise"] > 0


def test_a_stopped_and_resumed_run_is_one_wandb_run_and_one_tensorboard_log(stores, tmp_path, monkeypatch):
    """The real wandb, offline: the run stopped by SIGTERM at step 2 and resumed by the same
    command logs to one wandb run (its id kept in the run directory), quietly; TensorBoard's
    scalars of both parts land in one folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    path = tmp_path / "run.yaml"
    config(stores, run)
    sets = ["--set", "train.steps=4", "--set", "logging.wandb=true", "--set", "logging.tensorboard=true"]
    step = Trainer.train_step

    def stopped(self):
        out = step(self)
        if self.step == 2:
            signal.raise_signal(signal.SIGTERM)
        return out

    monkeypatch.setattr(Trainer, "train_step", stopped)
    assert cli.main(["train", str(path), *sets]) == 143
    monkeypatch.setattr(Trainer, "train_step", step)
    assert cli.main(["train", str(path), *sets]) == 0
    run_id = (run / "wandb_id").read_text().strip()
    parts = sorted(p.name for p in (run / "wandb").glob("offline-run-*"))
    # One wandb run, synced as one; two parts started within one second get wandb's "-1" suffix.
    assert len(parts) == 2 and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", p) for p in parts)
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx(losses(run), rel=1e-6)


def test_a_missing_logger_extra_is_one_line(stores, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    path = tmp_path / "run.yaml"
    config(stores, tmp_path / "run")
    assert cli.main(["train", str(path), "--set", "train.steps=1", "--set", "logging.wandb=true"]) == 2


def test_pipeline_stages_are_grouped_under_the_pipeline_name(tmp_path):
    """Every stage config the pipeline builds carries its wandb group: the pipeline's name,
    unless logging.wandb_group is set; without wandb nothing is set."""
    from doremi.pipeline.pipeline import Pipeline

    qs = Path(__file__).resolve().parents[1] / "experiments" / "configs" / "quickstart.yaml"
    base = [f"pipeline.run_dir={tmp_path / 'pipe'}", f"data.store_dir={tmp_path / 'stores'}"]
    pipe = Pipeline(qs, [*base, "logging.wandb=true"], say=lambda m: None)
    assert pipe.stage_config(pipe.p.main).logging.wandb_group == "pipe"
    named = Pipeline(qs, [*base, "logging.wandb=true", "logging.wandb_group=g"], say=lambda m: None)
    assert named.stage_config(named.p.main).logging.wandb_group == "g"
    off = Pipeline(qs, base, say=lambda m: None)
    assert off.stage_config(off.p.main).logging.wandb_group is None


def test_wandb_logs_the_proxy_mixing_signals(stores, tmp_path, fake_wandb):
    common = ["train.decay=constant", "train.warmup_steps=0", "train.steps=2"]
    ref = tmp_path / "reference"
    stages.train_reference(config(stores, ref, *common))
    proxy = tmp_path / "proxy"
    stages.train_proxy(config(stores, proxy, *common, f"mixing.doremi.reference={ref}", "logging.wandb=true"))
    assert fake_wandb.inits[-1]["name"] == f"proxy:{proxy}"
    history = read_jsonl(proxy / "domain_weights.jsonl")
    row, step = next((r, s) for r, s in reversed(fake_wandb.rows) if "loss" in r)  # the last train row
    assert step == 2
    domains = history[-1]["domains"]
    assert [row[f"excess_loss/{d}"] for d in domains] == history[-1]["excess"]
    assert [row[f"reference_loss/{d}"] for d in domains] == history[-1]["ref_loss"]
    assert [row[f"domain_weights/{d}"] for d in domains] == history[-1]["weights"]


# -- rank 0 only ----------------------------------------------------------------------------------

COMMANDS = [
    ["train", "missing.yaml"],
    ["train-reference", "missing.yaml"],
    ["train-proxy", "missing.yaml"],
    ["score", "missing.yaml"],
    ["preprocess", "missing.yaml"],
    ["pipeline", "missing.yaml"],
    ["plan", "missing.yaml", "--gpus", "1", "--gpu-memory", "80"],
    ["eval", "/nonexistent/run"],
    ["average", "/nonexistent/run"],
    ["compare", "/nonexistent/run", "--out", "/nonexistent/out"],
]


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: a[0])
def test_errors_print_on_rank0_only(argv, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    assert cli.main(argv) == 2
    assert capsys.readouterr() == ("", "")
    monkeypatch.setenv("RANK", "0")
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"doremi {argv[0]}: error: "), err


def _agree(rank: int, world_size: int) -> None:
    import torch

    from trainer.run.interrupt import StopRequests

    stops = StopRequests()
    pc = types.SimpleNamespace(distributed=True, device=torch.device("cpu"))
    assert stops.agreed(pc) == 0
    if rank == 1:
        stops.signum = int(signal.SIGTERM)
    assert stops.agreed(pc) == int(signal.SIGTERM)  # rank 0 stops at the same step as rank 1


def test_ranks_agree_on_a_signal_one_of_them_got():
    from tests.distributed import spawn

    spawn(_agree, 2)


def test_a_cpu_build_on_a_gpu_node_is_said(tmp_path, monkeypatch):
    """A GPU node whose torch has no CUDA trains on the CPU: the start-up says so in a line."""
    import torch

    from trainer.records.run_report import cpu_build_note

    driver = tmp_path / "version"
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    assert cpu_build_note(torch.device("cpu"), driver) is None  # no driver: a CPU machine
    driver.write_text("NVRM version: 550\n")
    note = cpu_build_note(torch.device("cpu"), driver)
    assert note.startswith(f"warning: this node has NVIDIA GPUs but torch {torch.__version__} is a CPU build")
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    assert cpu_build_note(torch.device("cpu"), driver) is None  # a CUDA build asked for the CPU
