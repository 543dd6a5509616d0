"""Model features under parallel layouts beyond the tests', each against one process with the
same config (MoE, hybrid Mamba-2, FP8, DoReMi proxies on them; resumes across layouts).

    OMP_NUM_THREADS=1 PYTHONPATH=. python experiments/tools/layout_probe.py run NAME   # one run
    OMP_NUM_THREADS=1 PYTHONPATH=. python experiments/tools/layout_probe.py cmp [NAME ...]

`run` trains the configuration NAME of `J` (spawning tp x pp x dp gloo processes; a resume name
first copies the run it resumes, see `RESUME_FROM`); `cmp` prints each run's largest differences
from its one-process reference: losses and validation (relative), final parameters (absolute),
DoReMi weights, grad norms, MoE balance and z-losses, expert token counts. Reference runs first.
The work directory is $LAYOUT_PROBE_ROOT (default runs/layout_probe). Results of 2026-12-05:
experiments/results/layouts_cpu.md.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

from tests.test_fp8 import COMMON
from tests.test_mamba import HYBRID
from tests.test_moe import MOE

ROOT = Path(os.environ.get("LAYOUT_PROBE_ROOT", "runs/layout_probe")).resolve()
STORE = ROOT / "stores"
R = ROOT / "runs"

MOE_SIG = [*MOE, "model.moe.gating=sigmoid"]
HYB = HYBRID
HYB6 = [*HYB, "model.n_layers=6", "model.block_pattern=MMAMAA"]
FP8D = ["model.fp8.layers=[qkv,proj,gate_up,down]", "model.fp8.amax_history=4"]
FP8R = ["model.fp8.scaling=rowwise", "model.fp8.grad_dtype=e4m3"]
EP2 = ["parallelism.dp=2", "parallelism.ep=2"]
P = "parallelism."

# name: (stage, sets, model_sets for final_params, reference run name or None)
J: dict[str, tuple[str, list[str], list[str], str | None]] = {
    # MoE
    "moe-single": ("train", MOE, MOE, None),
    "moe-single-4": ("train", [*MOE, "train.steps=4"], MOE, None),
    "moe-ep2-tp2-pp2": ("train", [*MOE, *EP2, P + "tp=2", P + "pp=2", "train.micro_batches=2"], MOE, "moe-single"),
    "moe-ep4-dp4": ("train", [*MOE, P + "dp=4", P + "ep=4"], MOE, "moe-single"),
    "moe-ep2-pp4-mb4": ("train", [*MOE, *EP2, P + "pp=4", "train.micro_batches=4"], MOE, "moe-single"),
    "moe-tp2-sp-async": (
        "train",
        [*MOE, P + "tp=2", P + "sequence_parallel=true", P + "tp_async=true"],
        MOE,
        "moe-single",
    ),
    "moe-ep2-tp2-sp-async": (
        "train",
        [*MOE, *EP2, P + "tp=2", P + "sequence_parallel=true", P + "tp_async=true"],
        MOE,
        "moe-single",
    ),
    "moe-sig-single": ("train", MOE_SIG, MOE_SIG, None),
    "moe-sig-ep2-tp2": ("train", [*MOE_SIG, *EP2, P + "tp=2"], MOE_SIG, "moe-sig-single"),
    "moe-ep2-sel": ("train", [*MOE, *EP2, P + "recompute=selective"], MOE, "moe-single"),
    "moe-ep2-full": ("train", [*MOE, *EP2, P + "recompute=full"], MOE, "moe-single"),
    "moe-ckpt-ep2-tp2": ("train", [*MOE, *EP2, P + "tp=2", "train.steps=2"], MOE, None),
    "moe-resume-ep1": ("train", [*MOE, "train.steps=4"], MOE, "moe-single-4"),
    "moe-resume-ep4-dp4": ("train", [*MOE, P + "dp=4", P + "ep=4", "train.steps=4"], MOE, "moe-single-4"),
    # hybrid
    "hyb6-single": ("train", [*HYB6, *COMMON], HYB6, None),
    "hyb6-pp3": ("train", [*HYB6, *COMMON, P + "pp=3", "train.micro_batches=4"], HYB6, "hyb6-single"),
    "hyb-single": ("train", [*HYB, *COMMON], HYB, None),
    "hyb-single-4": ("train", [*HYB, *COMMON, "train.steps=4"], HYB, None),
    "hyb-tp2-pp2-dp2-sel": (
        "train",
        [*HYB, *COMMON, P + "tp=2", P + "pp=2", P + "dp=2", P + "recompute=selective", "train.micro_batches=2"],
        HYB,
        "hyb-single",
    ),
    "hyb-dp4-zero1": ("train", [*HYB, *COMMON, P + "dp=4", P + "zero1=true"], HYB, "hyb-single"),
    "hyb-ckpt-tp2-pp2": (
        "train",
        [*HYB, *COMMON, P + "tp=2", P + "pp=2", "train.micro_batches=2", "train.steps=2"],
        HYB,
        None,
    ),
    "hyb-resume-pp1-dp2": ("train", [*HYB, *COMMON, P + "dp=2", "train.steps=4"], HYB, "hyb-single-4"),
    # FP8
    "fp8d-single": ("train", [*COMMON, *FP8D, "train.steps=6", "checkpoint.every=1", "checkpoint.keep=10"], [], None),
    "fp8d-tp2-dp2-whole": (
        "train",
        [*COMMON, *FP8D, "train.steps=6", "checkpoint.every=1", "checkpoint.keep=10", P + "tp=2", P + "dp=2"],
        [],
        "fp8d-single",
    ),
    "fp8d-tp2-dp2-crashed": (
        "train",
        [*COMMON, *FP8D, "train.steps=6", "checkpoint.every=1", "checkpoint.keep=10", P + "tp=2", P + "dp=2"],
        [],
        "fp8d-tp2-dp2-whole",
    ),
    "fp8d-single-mb2": ("train", [*COMMON, *FP8D, "train.steps=3", "train.micro_batches=2"], [], "fp8d-single"),
    "fp8d-tp2": ("train", [*COMMON, *FP8D, "train.steps=3", P + "tp=2"], [], "fp8d-single"),
    "fp8d-dp2": ("train", [*COMMON, *FP8D, "train.steps=3", P + "dp=2"], [], "fp8d-single"),
    "fp8d-tp2-dp2-sp-mb2": (
        "train",
        [
            *COMMON,
            *FP8D,
            "train.steps=3",
            P + "tp=2",
            P + "dp=2",
            P + "sequence_parallel=true",
            "train.micro_batches=2",
        ],
        [],
        "fp8d-single",
    ),
    "fp8d-single-mb2-6": (
        "train",
        [*COMMON, *FP8D, "train.steps=6", "checkpoint.every=1", "checkpoint.keep=10", "train.micro_batches=2"],
        [],
        None,
    ),
    "fp8r-single-mb2": ("train", [*COMMON, *FP8R, "train.micro_batches=2"], [], None),
    "fp8r-single": ("train", [*COMMON, *FP8R], [], None),
    "fp8r-pp2-sel": (
        "train",
        [*COMMON, *FP8R, P + "pp=2", P + "recompute=selective", "train.micro_batches=2"],
        [],
        "fp8r-single",
    ),
    # DoReMi
    "moe-ref": ("train-reference", MOE, MOE, None),
    "moe-proxy-single": ("train-proxy", [*MOE, f"mixing.doremi.reference={R / 'moe-ref'}"], MOE, None),
    "moe-proxy-ep2-pp2": (
        "train-proxy",
        [*MOE, f"mixing.doremi.reference={R / 'moe-ref'}", *EP2, P + "pp=2", "train.micro_batches=2"],
        MOE,
        "moe-proxy-single",
    ),
    "hyb6-ref": ("train-reference", [*HYB6, *COMMON], HYB6, None),
    "hyb6-proxy-single": (
        "train-proxy",
        [*HYB6, *COMMON, "train.steps=4", f"mixing.doremi.reference={R / 'hyb6-ref'}"],
        HYB6,
        None,
    ),
    "hyb6-proxy-pp3": (
        "train-proxy",
        [
            *HYB6,
            *COMMON,
            "train.steps=4",
            f"mixing.doremi.reference={R / 'hyb6-ref'}",
            P + "pp=3",
            "train.micro_batches=4",
        ],
        HYB6,
        "hyb6-proxy-single",
    ),
}
MOE8 = [*MOE, "model.moe.num_experts=8"]
MOE1 = [*MOE, "model.moe.top_k=1", "model.moe.shared_experts=2"]
MOEF = [*MOE, "model.fp8.layers=[qkv,proj]", "model.fp8.amax_history=4", "train.micro_batches=2"]
HM = [
    *HYB6,
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.moe.aux_loss_coef=0.1",
    "model.moe.z_loss_coef=0.01",
]
J.update(
    {
        "x-moe8-single": ("train", MOE8, MOE8, None),
        "x-moe8-ep4-dp4-tp2": ("train", [*MOE8, P + "dp=4", P + "ep=4", P + "tp=2"], MOE8, "x-moe8-single"),
        "x-moe1-single": ("train", MOE1, MOE1, None),
        "x-moe1-ep2-tp2-sp": ("train", [*MOE1, *EP2, P + "tp=2", P + "sequence_parallel=true"], MOE1, "x-moe1-single"),
        "x-moe-ep2-pp2-full-afab": (
            "train",
            [*MOE, *EP2, P + "pp=2", P + "recompute=full", P + "pp_schedule=afab", "train.micro_batches=4"],
            MOE,
            "moe-single",
        ),
        "x-moe-ckpt-ep4-dp4": ("train", [*MOE, P + "dp=4", P + "ep=4", "train.steps=2"], MOE, None),
        "x-moe-resume-ep2-tp2-pp2": (
            "train",
            [*MOE, *EP2, P + "tp=2", P + "pp=2", "train.micro_batches=2", "train.steps=4"],
            MOE,
            "moe-single-4",
        ),
        "x-moef-single": ("train", MOEF, MOE, None),
        "x-moef-ep2-tp2": ("train", [*MOEF[:-1], *EP2, P + "tp=2"], MOE, "x-moef-single"),
        "x-hyb6-tp2-pp3-sp": (
            "train",
            [*HYB6, *COMMON, P + "tp=2", P + "pp=3", P + "sequence_parallel=true", "train.micro_batches=4"],
            HYB6,
            "hyb6-single",
        ),
        "x-hyb6-proxy-lag-single": (
            "train-proxy",
            [
                *HYB6,
                *COMMON,
                "train.steps=4",
                "mixing.doremi.update=lagged",
                f"mixing.doremi.reference={R / 'hyb6-ref'}",
            ],
            HYB6,
            None,
        ),
        "x-hyb6-proxy-lag-pp3": (
            "train-proxy",
            [
                *HYB6,
                *COMMON,
                "train.steps=4",
                "mixing.doremi.update=lagged",
                f"mixing.doremi.reference={R / 'hyb6-ref'}",
                P + "pp=3",
                "train.micro_batches=4",
            ],
            HYB6,
            "x-hyb6-proxy-lag-single",
        ),
        "x-hm-single": ("train", [*HM, *COMMON], HM, None),
        "x-hm-ep2-pp3": ("train", [*HM, *COMMON, *EP2, P + "pp=3", "train.micro_batches=4"], HM, "x-hm-single"),
        "x-hm-ep2-tp2-sp-sel": (
            "train",
            [*HM, *COMMON, *EP2, P + "tp=2", P + "sequence_parallel=true", P + "recompute=selective"],
            HM,
            "x-hm-single",
        ),
    }
)
J.update(
    {
        "x-hyb-pp3": ("train", [*HYB, *COMMON, P + "pp=3", "train.micro_batches=4"], HYB, "hyb-single"),
        "x-moe-ep2-pp3-1f1b-sel": (
            "train",
            [*MOE, *EP2, P + "pp=3", P + "recompute=selective", "train.micro_batches=4"],
            MOE,
            "moe-single",
        ),
    }
)
RESUME_FROM = {
    "x-moe-resume-ep2-tp2-pp2": "x-moe-ckpt-ep4-dp4",
    "moe-resume-ep1": "moe-ckpt-ep2-tp2",
    "moe-resume-ep4-dp4": "moe-ckpt-ep2-tp2",
    "hyb-resume-pp1-dp2": "hyb-ckpt-tp2-pp2",
}


def world(sets):
    w = 1
    for s in sets:
        k, v = s.split("=", 1)
        if k in (P + "tp", P + "pp", P + "dp"):
            w *= int(v)
    return w


def build_store():
    from data.preprocess.preprocess import preprocess
    from tests.runs import config

    if not STORE.exists():
        preprocess(config(STORE, ROOT / "unused").data, progress=False)


def run(name):
    from tests.distributed import spawn
    from tests.runs import run_stage

    torch.set_num_threads(1)
    build_store()
    R.mkdir(exist_ok=True)
    stage, sets, _, _ = J[name]
    d = R / name
    if name in RESUME_FROM:
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(R / RESUME_FROM[name], d)
    elif name == "fp8d-tp2-dp2-crashed":
        from trainer.checkpoint.checkpoint import checkpoint_dir

        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(R / "fp8d-tp2-dp2-whole", d)
        for step in (4, 5, 6):
            shutil.rmtree(checkpoint_dir(d, step))
    else:
        shutil.rmtree(d, ignore_errors=True)
    w = world(sets)
    if w == 1:
        run_stage(0, 1, stage, str(STORE), [(str(d), sets)])
    else:
        spawn(run_stage, w, stage, str(STORE), [(str(d), sets)])


def pdiff(a, b):
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def rel(a, b):
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def extra(a, b):
    from trainer.records.metrics import read_jsonl

    ra, rb = list(read_jsonl(a / "metrics.jsonl")), list(read_jsonl(b / "metrics.jsonl"))
    out = {}
    da = {r["step"]: list(r["val_loss"].values()) for r in ra if "val_loss" in r}
    db = {r["step"]: list(r["val_loss"].values()) for r in rb if "val_loss" in r}
    common = sorted(set(da) & set(db))
    va = [x for k in common for x in da[k]]
    vb = [x for k in common for x in db[k]]
    if vb:
        out["val_rel"] = rel(va, vb)
    ga = [r["grad_norm"] for r in ra if "loss" in r]
    gb = [r["grad_norm"] for r in rb if "loss" in r]
    out["gnorm_rel"] = rel(ga, gb)
    ma = [r for r in ra if "moe_balance_loss" in r]
    mb = [r for r in rb if "moe_balance_loss" in r]
    if mb:
        out["bal_rel"] = rel([r["moe_balance_loss"] for r in ma], [r["moe_balance_loss"] for r in mb])
        out["z_rel"] = rel([r["moe_z_loss"] for r in ma], [r["moe_z_loss"] for r in mb])
        out["tokens_eq"] = [r["moe_expert_tokens"] for r in ma] == [r["moe_expert_tokens"] for r in mb]
    return out


def cmp(names):
    from tests.runs import alphas, final_params, losses

    for name in names:
        stage, sets, msets, ref = J[name]
        if ref is None or not (R / name).exists():
            continue
        try:
            out = {"loss_rel": rel(losses(R / name), losses(R / ref)), "n": len(losses(R / name))}
            if stage == "train-proxy":
                a, b = alphas(R / name), alphas(R / ref)
                out["alpha_abs"] = (
                    max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
                    if len(a) == len(b)
                    else f"len {len(a)} vs {len(b)}"
                )
            out.update(extra(R / name, R / ref))
            got, want = final_params(STORE, R / name, *msets), final_params(STORE, R / ref, *msets)
            out["param_abs"] = pdiff(got, want)
            if name.startswith("fp8"):
                from tests.runs import config
                from trainer.build import build_model
                from trainer.parallel.context import ParallelContext

                m = build_model(config(STORE, R / "init-tmp", *msets), ParallelContext.single())
                start = {n: p.detach() for n, p in m.named_parameters()}
                num = sum(float((got[p] - want[p]).pow(2).sum()) for p in want)
                den = sum(float((want[p] - start[p]).pow(2).sum()) for p in want)
                out["update_err"] = (num / den) ** 0.5
        except Exception as e:  # noqa
            out = {"error": repr(e)[:300]}
        print(
            name,
            "vs",
            ref,
            json.dumps({k: (f"{v:.2e}" if isinstance(v, float) else v) for k, v in out.items()}),
            flush=True,
        )


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2])
    else:
        cmp(sys.argv[2:] or list(J))
