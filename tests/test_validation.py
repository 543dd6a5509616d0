"""No silent wrong results: keys a stage would ignore, inputs reported only after hours of work,
and failures that were tracebacks are one-line errors (exit status 2) before any work starts."""

import errno
import json

import pytest
import torch

from data.config import DataConfig, DomainSource
from data.errors import DataError
from data.preprocess.preprocess import preprocess
from data.sampling.weights import resolve_weights
from data.store.store import read_manifest
from doremi.commands.cli import main
from doremi.methods.history import HistoryError, WeightHistory, read_weights_json
from tests.runs import config_path

DOMAINS = ["noise", "easy", "markov"]


def run_cli(capsys, *args) -> tuple[int, list[str]]:
    """Exit status and stderr lines of `doremi ARGS` run in this process."""
    rc = main([str(a) for a in args])
    return rc, capsys.readouterr().err.splitlines()


def one_error(capsys, *args) -> str:
    rc, err = run_cli(capsys, *args)
    assert rc == 2 and len(err) == 1, (rc, err)
    return err[0]


# ---- 7. keys silently ignored -------------------------------------------------------------------


def fake_proxy(run, average_from_step=None, steps=4):
    """A proxy run directory: a weight history whose alpha_t is one-hot on domain t % 3."""
    run.mkdir(parents=True)
    with WeightHistory(run, domains=DOMAINS) as h:
        for t in range(1, steps + 1):
            w = [1.0 if d == t % 3 else 0.0 for d in range(3)]
            h.append({"step": t, "weights": w, "excess": w, "proxy_loss": w, "ref_loss": w, "tokens": [1, 1, 1]})
    doremi = {} if average_from_step is None else {"average_from_step": average_from_step}
    (run / "config.yaml").write_text(json.dumps({"doremi": {"eta": 1.0, **doremi}}))
    return run


def test_average_reads_the_runs_average_from_step(tmp_path, capsys):
    run = fake_proxy(tmp_path / "proxy", average_from_step=3)
    assert run_cli(capsys, "average", run)[0] == 0
    doc = json.loads((run / "weights.json").read_text())
    assert doc["from_step"] == 3 and doc["steps_averaged"] == 2 and doc["weights"] == [0.5, 0.5, 0.0]
    assert run_cli(capsys, "average", run, "--from-step", "1")[0] == 0  # the flag still wins
    assert json.loads((run / "weights.json").read_text())["steps_averaged"] == 4
    plain = fake_proxy(tmp_path / "plain")  # no mixing.doremi.average_from_step: from step 1
    assert run_cli(capsys, "average", plain)[0] == 0
    assert json.loads((plain / "weights.json").read_text())["steps_averaged"] == 4


def test_average_refuses_a_bad_saved_average_from_step(tmp_path, capsys):
    run = fake_proxy(tmp_path / "proxy", average_from_step="3")
    assert one_error(capsys, "average", run).endswith("mixing.doremi.average_from_step: expected an int >= 1, got '3'")


@pytest.mark.parametrize(
    "stage, takes",
    [("train-reference", "mixing.doremi.reference_weights"), ("train-proxy", "mixing.doremi.proxy_sampling")],
)
def test_stages_refuse_domain_weights_they_ignore(stores, tmp_path, capsys, stage, takes):
    cfg = config_path(stores, tmp_path / "run")
    msg = one_error(
        capsys,
        stage,
        cfg,
        "--set",
        "data.domain_weights=tokens",
        "--set",
        f"mixing.doremi.reference={tmp_path / 'none'}",
    )
    assert msg == (
        f"doremi {stage}: error: data.domain_weights: doremi {stage} does not read this key, it "
        f"{'trains on' if stage == 'train-reference' else 'samples its data from'} {takes}; "
        f"got 'tokens' (set {takes} instead)"
    )
    assert not (tmp_path / "run").exists()


def test_reference_accepts_its_own_saved_domain_weights(stores, tmp_path):
    """A reference's config.yaml records its weights as data.domain_weights too: not ignored."""
    from doremi.pipeline.validate import check_stage
    from tests.runs import config

    cfg = config(stores, tmp_path / "r", "mixing.doremi.reference_weights=[1, 2, 3]", "data.domain_weights=[1, 2, 3]")
    check_stage(cfg, "train-reference")
    with pytest.raises(DataError, match=r"^mixing.doremi.reference_weights: expected 3 weights"):
        check_stage(config(stores, tmp_path / "r", "mixing.doremi.reference_weights=[1, 2]"), "train-reference")


@pytest.mark.parametrize(
    "key", ["data.domain_weights", "mixing.doremi.reference_weights", "mixing.doremi.proxy_sampling"]
)
@pytest.mark.parametrize(
    "value, at, given",
    [
        ("[true, false, true]", "[0]", "True (bool)"),
        ("[0.5, '0.25', 0.25]", "[1]", "'0.25' (str)"),
        ("{noise: 1, easy: yes, markov: 1}", ".easy", "True (bool)"),
        ("{noise: '1', easy: 1, markov: 1}", ".noise", "'1' (str)"),
    ],
)
def test_weights_in_the_config_must_be_numbers(stores, tmp_path, capsys, key, value, at, given):
    msg = one_error(capsys, "train", config_path(stores, tmp_path / "run"), "--set", f"{key}={value}")
    assert msg == f"doremi train: error: {key}{at}: expected a number (int or float), got {given}"


def test_weights_files_must_hold_numbers(stores, tmp_path):
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"domains": DOMAINS, "weights": [True, False, True]}))
    manifest = read_manifest(stores)
    with pytest.raises(DataError, match=r"w.json: weights\[noise\]: expected a number \(int or float\), got True"):
        resolve_weights(str(path), manifest)
    with pytest.raises(HistoryError, match="expected finite non-negative numbers summing to 1"):
        path.write_text(json.dumps({"domains": ["a", "b"], "weights": [True, False]}))
        read_weights_json(path)
    with pytest.raises(DataError, match=r"^mixing.doremi.proxy_sampling: weights file .*nope.json not found"):
        resolve_weights(str(tmp_path / "nope.json"), manifest, "mixing.doremi.proxy_sampling")


# ---- 8. the whole pipeline validated before any work --------------------------------------------

PIPELINE_YAML = """
model: {{vocab_size: 260, d_model: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, ffn_dim: 64, max_seq_len: 32}}
data:
  domains:
    - {{name: noise, synthetic: {{kind: noise, num_tokens: 3000, vocab: 16}}}}
    - {{name: easy, synthetic: {{kind: repeat, num_tokens: 3000, vocab: 16}}}}
  store_dir: {root}/stores
  seq_len: 16
train: {{steps: 2, global_batch_size: 4}}
logging: {{progress: false}}
pipeline: {{run_dir: {root}/run, baselines: [uniform, tokens]}}
"""


def pipeline_error(tmp_path, capsys, *sets) -> str:
    exp = tmp_path / "exp.yaml"
    exp.write_text(PIPELINE_YAML.format(root=tmp_path))
    args = [a for s in sets for a in ("--set", s)]
    msg = one_error(capsys, "pipeline", exp, *args)
    assert not (tmp_path / "stores").exists() and not (tmp_path / "run").exists()  # no work done
    return msg.removeprefix("doremi pipeline: error: ")


def weights_file(path, domains, weights):
    path.write_text(json.dumps({"domains": domains, "weights": weights}))
    return path


@pytest.mark.parametrize(
    "sets, expect",
    [
        (["pipeline.main.train.lrr=1"], "pipeline.main: unknown key train.lrr (did you mean train.lr?)"),
        (
            ["pipeline.proxy.model.d_model=30"],
            "pipeline.proxy: model.d_model: expected a multiple of n_heads=4, got 30",
        ),
        (
            ["pipeline.main.train.global_batch_size=3", "pipeline.main.train.micro_batches=2"],
            "pipeline.main: train.global_batch_size: expected a multiple of",
        ),
        (
            ["pipeline.proxy.mixing.doremi.proxy_sampling=[1]"],
            "pipeline.proxy.mixing.doremi.proxy_sampling: expected 2 weights",
        ),
        (
            ["mixing.doremi.reference_weights={noise: 1}"],
            "mixing.doremi.reference_weights: domains must match the stores' (noise, easy); unknown: -; missing: easy",
        ),
        (["pipeline.main.data.domain_weights=tokens"], "pipeline.main.data.domain_weights: set by the pipeline"),
        (
            ["pipeline.proxy.mixing.doremi.reference_weights=tokens"],
            "pipeline.proxy.mixing.doremi.reference_weights: set by the pipeline",
        ),
        (
            ["pipeline.main.data.store_dir=elsewhere"],
            "pipeline.main.data.store_dir: the pipeline builds one set of stores",
        ),
        (["data.domain_weights=tokens"], "data.domain_weights: doremi pipeline does not read this key"),
        (["pipeline.baselines=[uniform, missing.json]"], "pipeline.baselines[1]: weights file missing.json not found"),
        (["pipeline.methods=[doremi, foo]"], "pipeline.methods[1]: expected one of doremi, doge, odm, aioli, ado"),
        (["pipeline.online=[doremi]"], "pipeline.online[0]: expected one of doge, odm, aioli, ado, got 'doremi'"),
        (
            ["pipeline.methods=[aioli]", "mixing.aioli.sweeps=4"],
            "pipeline.proxy: mixing.aioli.rounds: expected rounds longer than their probes",
        ),
        (["pipeline.online=[ado]", "mixing.ado.floor=0.9"], "pipeline.main: mixing.ado.floor: expected at most 1/2"),
        (["pipeline.baselines=[temperature:0]"], "pipeline.baselines[0]: expected uniform, tokens, temperature:T"),
        # the pipeline sets the methods per run: a top-level one would make every run that method
        (["mixing.main=odm"], "mixing.main: doremi pipeline sets this key for each of its runs, so 'odm' would"),
        (["mixing.method=odm"], "mixing.method: doremi pipeline sets this key for each of its runs"),
        (["pipeline.main.mixing.main=odm"], "pipeline.main.mixing.main: set by the pipeline"),
        (
            ["pipeline.methods=[regmix]", "sweep.temperature=0"],
            "pipeline.proxy: sweep.temperature: expected a finite value > 0, got 0",
        ),
        (["pipeline.methods=[regmix]", "sweep.prior={noise: 1}"], "pipeline.proxy: sweep.prior: "),
        (["pipeline.proxy.mixing.method=doge"], "pipeline.proxy.mixing.method: set by the pipeline"),
    ],
)
def test_pipeline_config_is_validated_before_any_work(tmp_path, capsys, sets, expect):
    assert pipeline_error(tmp_path, capsys, *sets).startswith(expect)


def test_pipeline_baseline_and_reference_files_are_checked_first(tmp_path, capsys):
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    assert pipeline_error(tmp_path, capsys, f"pipeline.baselines=[{bad_json}]").startswith(
        f"{bad_json}: expected JSON with 'domains' and 'weights' lists"
    )
    other = weights_file(tmp_path / "other.json", ["noise", "code"], [0.5, 0.5])
    assert pipeline_error(tmp_path, capsys, f"pipeline.baselines=[uniform, {other}]") == (
        f"{other}: domains must match the stores' (noise, easy); unknown: code; missing: easy"
    )
    flags = weights_file(tmp_path / "flags.json", ["noise", "easy"], [True, False])
    assert pipeline_error(tmp_path, capsys, f"mixing.doremi.reference_weights={flags}") == (
        f"{flags}: weights[noise]: expected a number (int or float), got True (bool)"
    )
    taken = weights_file(tmp_path / "doremi.json", ["noise", "easy"], [0.5, 0.5])
    assert pipeline_error(tmp_path, capsys, f"pipeline.baselines=[{taken}]").startswith(
        "pipeline.baselines[0]: main run name 'doremi' (the file's stem) is taken by doremi's own run"
    )
    odm = weights_file(tmp_path / "odm.json", ["noise", "easy"], [0.5, 0.5])
    assert pipeline_error(tmp_path, capsys, "pipeline.methods=[doremi, odm]", f"pipeline.baselines=[{odm}]").startswith(
        "pipeline.baselines[0]: main run name 'odm' (the file's stem) is taken by pipeline.methods' odm run"
    )
    online = weights_file(tmp_path / "ado-online.json", ["noise", "easy"], [0.5, 0.5])
    assert pipeline_error(tmp_path, capsys, "pipeline.online=[ado]", f"pipeline.baselines=[{online}]").startswith(
        "pipeline.baselines[0]: main run name 'ado-online' (the file's stem) is taken by pipeline.online's ado run"
    )


def test_valid_pipeline_config_passes(tmp_path):
    from doremi.pipeline.pipeline import Pipeline

    exp = tmp_path / "exp.yaml"
    exp.write_text(PIPELINE_YAML.format(root=tmp_path))
    good = weights_file(tmp_path / "mix.json", ["easy", "noise"], [1, 3])
    pipe = Pipeline(
        exp,
        [
            f"pipeline.baselines=[uniform, tokens, {good}]",
            "pipeline.main.train.steps=3",
            "pipeline.proxy.data.seq_len=8",
        ],
        say=lambda _: None,
    )
    assert list(pipe.mixtures(tmp_path / "w.json")) == ["doremi", "uniform", "tokens", "mix"]


# ---- 9. operating-system errors and a missing device: one line, exit status 2 -------------------


def test_run_dir_that_is_a_file(stores, tmp_path, capsys):
    run = tmp_path / "run"
    run.write_text("not a directory")
    msg = one_error(capsys, "train", config_path(stores, tmp_path / "cfg"), "--set", f"train.run_dir={run}")
    assert msg.startswith(f"doremi train: error: {run}: ")  # today: File exists (a file where a directory ...)
    assert run.read_text() == "not a directory"


def test_store_dir_under_a_file(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    exp = tmp_path / "exp.yaml"
    exp.write_text(PIPELINE_YAML.format(root=blocker))
    assert one_error(capsys, "preprocess", exp) == f"doremi preprocess: error: {blocker / 'stores'}: Not a directory"


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES])
def test_write_failures_are_one_line_and_leave_nothing(tmp_path, capsys, monkeypatch, code):
    """A full disk fails in write or fsync, with no file name: the atomic write names it."""
    import data.atomic

    run = fake_proxy(tmp_path / "proxy")

    def fail(fd):
        raise OSError(code, __import__("os").strerror(code))

    monkeypatch.setattr(data.atomic.os, "fsync", fail)
    msg = one_error(capsys, "average", run)
    assert msg == f"doremi average: error: {run / 'weights.json'}: {__import__('os').strerror(code)}"
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "domain_weights.jsonl"]


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="needs a CPU-only PyTorch build")
def test_cuda_on_a_cpu_build(stores, tmp_path, capsys):
    cfg = config_path(stores, tmp_path / "run")
    assert one_error(capsys, "train", cfg, "--set", "train.device=cuda") == (
        f"doremi train: error: train.device='cuda': this PyTorch build has no CUDA (torch {torch.__version__}); "
        f"use train.device cpu or auto"
    )
    assert "parallelism.backend: 'nccl' runs on CUDA devices" in one_error(
        capsys, "train", cfg, "--set", "parallelism.backend=nccl", "--set", "train.device=cpu"
    )
    assert not (tmp_path / "run").exists()
    from tests.runs import config
    from trainer.build import check_device

    for device, backend in [("cpu", "auto"), ("cpu", "gloo"), ("auto", "auto"), ("auto", "gloo")]:
        check_device(config(stores, tmp_path / "run", f"train.device={device}", f"parallelism.backend={backend}"))


def test_only_rank_0_prints_a_user_error(tmp_path, capsys, monkeypatch):
    exp = tmp_path / "exp.yaml"
    exp.write_text("train: {stepz: 1}\n")
    monkeypatch.setenv("RANK", "1")
    assert run_cli(capsys, "train", exp) == (2, [])
    monkeypatch.setenv("RANK", "0")
    assert one_error(capsys, "train", exp).startswith("doremi train: error: unknown key train.stepz")


# ---- 11. a domain of whitespace-only documents is empty -----------------------------------------


def test_whitespace_only_domain_is_refused_by_name(tmp_path):
    def jsonl(name, texts):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        return DomainSource(name=name, paths=[str(path)])

    mixed = jsonl("mixed", ["a b", " ", "\n\t", "c"])
    cfg = DataConfig(domains=[mixed], store_dir=str(tmp_path / "ok"), num_proc=1, validation_fraction=0.0)
    assert preprocess(cfg, progress=False).domain("mixed").train.documents == 2  # blanks dropped
    cfg = DataConfig(
        domains=[mixed, jsonl("blank", ["   ", "\n\n", "\t \r\n"] * 20)], store_dir=str(tmp_path / "stores"), num_proc=1
    )
    with pytest.raises(
        DataError,
        match=r"^domain 'blank': empty domain \(files:blank.jsonl has only empty or "
        r"whitespace-only documents\)$",
    ):
        preprocess(cfg, progress=False)
    assert not (tmp_path / "stores" / "manifest.json").exists()


def test_full_disk_during_a_metrics_append_names_the_file(tmp_path):
    """metrics.jsonl is appended every step; a full disk there names the file like any other write."""
    from trainer.records.metrics import JsonlWriter

    writer = JsonlWriter(tmp_path / "metrics.jsonl")

    class Full:
        def write(self, _):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            pass

    writer._f.close()
    writer._f = Full()
    with pytest.raises(OSError) as e:
        writer.write({"step": 1})
    assert (e.value.errno, e.value.filename) == (errno.ENOSPC, str(tmp_path / "metrics.jsonl"))
