"""The smaller cases of issue 41 (item 7): `train.eval_every: 0` evaluates at the end, and the
guardrail says why when no evaluation ran; SIGINT is acknowledged at once and stops at the next
step; a full disk while writing a model file is one line naming the file; a JSON-lines or text
source that is not UTF-8 or not JSON names the file and the true line."""

from __future__ import annotations

import errno
import json
import signal

import pytest

from data.errors import DataError
from data.sources.sources import first_non_utf8, read_jsonl_rows
from doremi.pipeline import stages
from tests.runs import config, config_path
from trainer.checkpoint.checkpoint import latest_checkpoint
from trainer.records.metrics import read_jsonl
from trainer.run.loop import Trainer

# -- train.eval_every: 0 -------------------------------------------------------------------------


def test_eval_every_0_evaluates_only_at_the_end(stores, tmp_path):
    """docs/config.md: `0: only at the end`; the loop used to skip every evaluation."""
    run = tmp_path / "run"
    stages.train(config(stores, run, "train.eval_every=0", "train.steps=3"))
    val = [r for r in read_jsonl(run / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in val] == [3]
    assert set(val[0]["val_loss"]) == {"noise", "easy", "markov"}


def test_guardrail_names_the_true_reason_when_no_evaluation_ran():
    from doremi.reports.guardrails import measure

    rows = [{"step": 2, "loss": 1.0, "epochs": {"a": 0.5}}]
    m = measure("ref", "reference", rows, 8)
    assert "ref: no held-out evaluation (no evaluation logged: the run did not reach its end); " in " ".join(m.notes)
    evals = [*rows, {"step": 2, "val_loss": {"a": 1.0}}]
    assert (
        "ref: no held-out evaluation (data.holdout_sequences = 0); memorisation check skipped"
        in measure("ref", "reference", evals, 8).notes
    )


# -- SIGINT --------------------------------------------------------------------------------------


def test_sigint_is_acknowledged_at_once_and_stops_at_the_next_step(stores, tmp_path, monkeypatch, capfd):
    """logging.every 100 over 6 steps: the run used to act on the signal only at a logging step,
    so it trained to its end; now one process stops after the step the signal came in."""
    from doremi.commands import cli

    run = tmp_path / "run"
    path = config_path(stores, run)
    step = Trainer.train_step
    acknowledged: list[str] = []

    def signalled(self):
        out = step(self)
        if self.step == 2:
            signal.raise_signal(signal.SIGINT)
            acknowledged.append(capfd.readouterr().err)  # printed by the handler, before step 3
        return out

    monkeypatch.setattr(Trainer, "train_step", signalled)
    sets = ["--set", "train.steps=6", "--set", "logging.every=100", "--set", "checkpoint.every=0"]
    assert cli.main(["train", str(path), *sets]) == 130
    assert acknowledged[0].splitlines()[-1] == (
        "SIGINT received: saving a checkpoint and stopping at the next step; SIGINT again stops at once, unsaved"
    )
    assert (
        capfd.readouterr().err.splitlines()[-1]
        == f"doremi train: SIGINT: saved {run} at step 2; the same command resumes"
    )
    assert latest_checkpoint(run).name == "step_0000002"


def test_ranks_wait_for_a_logging_step_and_say_so():
    from trainer.run.interrupt import StopRequests

    assert StopRequests(every=10).acknowledgment(signal.SIGTERM) == (
        "SIGTERM received: saving a checkpoint and stopping at the next multiple of 10 steps (logging.every); "
        "SIGTERM again stops at once, unsaved"
    )


# -- disk full -----------------------------------------------------------------------------------


class _Full:
    def __init__(self, f):
        self.f = f

    def write(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
        pass


def test_disk_full_while_writing_a_checkpoint_is_one_line_naming_the_file(stores, tmp_path, monkeypatch, capsys):
    import trainer.checkpoint.checkpoint as ck
    from doremi.commands import cli

    init = ck._ChecksumWriter.__init__
    monkeypatch.setattr(ck._ChecksumWriter, "__init__", lambda self, f, path: init(self, _Full(f), path))
    run = tmp_path / "run"
    assert cli.main(["train", str(config_path(stores, run)), "--set", "train.steps=1"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert errors == [
        f"doremi train: error: {run}/checkpoints/step_0000001.tmp/model_pp0_tp0.pt: No space left on device"
    ]
    assert latest_checkpoint(run) is None


def test_disk_full_while_exporting_is_one_line_naming_the_file(stores, tmp_path, monkeypatch, capsys):
    """safetensors reports a failed write as its own error, which the CLI showed as a traceback."""
    pytest.importorskip("safetensors")
    from types import SimpleNamespace

    import trainer.hf.files as hf_files
    from doremi.commands import cli

    run = tmp_path / "run"
    stages.train(config(stores, run, "train.steps=1"))

    def full(tensors, filename, metadata=None):
        raise RuntimeError(
            f'Error while serializing: I/O error: No space left on device (os error 28) at path "{filename}.tmp"'
        )

    monkeypatch.setattr(hf_files, "_safetensors", lambda: SimpleNamespace(torch=SimpleNamespace(save_file=full)))
    out = tmp_path / "hf"
    capsys.readouterr()
    assert cli.main(["export", str(run), str(out)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("doremi export: error: ")
    assert err[0].endswith("model.safetensors: No space left on device")
    assert not out.exists()


# -- sources that are not UTF-8 or not JSON ------------------------------------------------------


def test_a_bad_json_line_names_the_file_and_its_true_line(tmp_path):
    """json.loads of one line says `line 1 column 1` whatever the file's line; blank lines count."""
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"text": "a"}) + "\n\n" + json.dumps({"text": "b"}) + "\n{not json\n")
    with pytest.raises(DataError) as e:
        read_jsonl_rows([str(path)], "text", "domain 'a'")
    assert str(e.value) == (
        f"domain 'a': could not read {path} as JSON lines: line 4: not valid JSON "
        "(Expecting property name enclosed in double quotes at column 2)"
    )
    path.write_text(json.dumps({"text": "a"}) + "\n[1, 2]\n")
    with pytest.raises(DataError, match=r"as JSON lines: line 2: expected a JSON object, got list$"):
        read_jsonl_rows([str(path)], "text", "domain 'a'")


def test_non_utf8_input_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError) as e:
        read_jsonl_rows([str(path)], "text", "domain 'a'")
    assert str(e.value) == (
        f"domain 'a': could not read {path} as JSON lines: line 2: not UTF-8 (byte 0xe9 at byte 14 of the "
        "line); re-encode the file as UTF-8"
    )
    text = tmp_path / "b.txt"
    text.write_bytes(b"one\ntwo\nthr\xffee\n")
    assert (
        first_non_utf8(str(text))
        == f"{text}: line 3: not UTF-8 (byte 0xff at byte 4 of the line); re-encode the file as UTF-8"
    )


def test_preprocess_of_a_non_utf8_text_file_names_the_line(tmp_path):
    pytest.importorskip("datasets")
    from data.config import DataConfig, DomainSource
    from data.preprocess.preprocess import preprocess

    text = tmp_path / "b.txt"
    text.write_bytes(b"one\n\ntwo\nthr\xffee\n")
    cfg = DataConfig(domains=[DomainSource(name="b", paths=[str(text)])], store_dir=str(tmp_path / "s"), num_proc=1)
    with pytest.raises(DataError) as e:
        preprocess(cfg, progress=False)
    assert str(e.value) == (
        f"domain 'b': {text}: line 4: not UTF-8 (byte 0xff at byte 4 of the line); re-encode the file as UTF-8"
    )
