"""FP8 linears on torchao against bf16 (issue 36 item 2): the compiled training step, and a run.

`step` (the default): at each size, in one process, the compiled training step of
- ours: `trainer.model.llama.Llama` (bf16 parameters, as `train.param_dtype: auto` on a GPU,
  fused AdamW, one process, `model.compile`), with `model.fp8` off (`bf16`) and on per scaling;
- plain: `plain_llama.Llama` (bf16 parameters, the whole model compiled), as it is (`bf16`) and
  with torchao's `convert_to_float8_training` per scaling (every linear but the head, as ours);
tokens/s, each FP8 step's ratio to its own model's bf16 step, and the graph breaks dynamo
counted while compiling each step (`torch._dynamo.utils.counters["graph_break"]`: FP8 must add
none). Sizes: `1b` (the `bench-1b` preset, plain_llama's `1b`) and `4096` (d_model 4096, 8
layers, 32 heads, 8 KV heads, ffn 14336). Acceptance (issue 36): tensorwise >= 1.20x at 1b and
>= 1.25x at 4096, and not below plain's ratio by more than 0.03.

`train`: the 120M main model of the first real-data study (experiments/results/doremi_real.md;
d 896, 12 layers, 14 heads, ffn 2432)
on the quickstart data (the embedded corpus), bf16 and FP8 tensorwise (`--with-head`: and a
`tensorwise+head` arm, the LM head in FP8 too), `--train-steps` steps
each from the same seed and batches (`--train-batch` x 512 tokens a step, the token-proportional
mixture: the corpus has about 1.07M training tokens, so 2000 steps of 8 sequences read it 7.6
times, and a uniform mixture would read its smallest domain 32 times: memorisation, not the
arithmetic, would then decide the validation loss; a run already finished under `--work` is
read, not rerun, so the arms can be split over calls); the training and validation curves in
one plot (`fp8_train.png`), the final validation losses (mean over domains), FP8's relative
difference, the steps whose loss or gradient norm was not finite (the trainer stops at the
first, `trainer.run.health`: its step is kept), each arm's seconds, and the acceptance (issue 36:
within 0.5% of bf16, no non-finite step). torchao's casts saturate, so an FP8 overflow shows
as a non-finite loss or gradient norm only where it reaches bf16 arithmetic.

Step options for the search of a higher ratio at 1b (experiments/notes/FP8.md): `--fp8-layers`
(the block linears in FP8, the same roles in ours and in plain), `--with-head` (per scaling, one
more row of each model with its LM head in FP8 too, `<scaling>+head`: ours with `head` in
`model.fp8.layers`, plain as `convert_to_float8_training` without a filter converts it; grid G1),
`--plain-head` (plain's head in FP8 in its every FP8 row, ours unchanged), and `--inductor
KEY=VALUE ...` (`torch._inductor.config` settings for every compile of the run).

`--smoke`: the same code on the CPU at toy sizes (train: `--config`'s model and data as they
are), FP8 in torchao's emulation, steps compiled with the `aot_eager` backend (dynamo's graph
breaks are counted as on the GPU): not a result.

Usage (repository root; torchao from `pip install -e .[fp8]`):
    python experiments/tools/bench/fp8_bench.py step [--sizes 1b 4096] [--scalings tensorwise] \\
        [--micro-batch 4] [--seq 2048] [--steps 10] [--warmup 3] [--fp8-layers qkv proj gate_up down] \\
        [--with-head] [--plain-head] [--inductor KEY=VALUE ...] [--out DIR]
    python experiments/tools/bench/fp8_bench.py train [--train-steps 2000] [--train-batch 8] [--with-head] [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from trainer.config.fp8 import FP8_LAYERS, HEAD, Fp8Config  # noqa: E402
from trainer.config.schema import ModelConfig, model_config  # noqa: E402
from trainer.model.fp8 import linear_config, native_fp8  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plain_llama  # noqa: E402
from timing import model_step_row, run_part, timed  # noqa: E402

#: model.fp8 (scaling, grad_dtype) per scaling, as torchao's recipes of those names.
SCALINGS = {"tensorwise": ("tensorwise", "e5m2"), "rowwise": ("rowwise", "e4m3")}
#: size -> (preset, overrides) of our model; plain_llama gets the same shape.
SIZES: dict[str, tuple[str, dict]] = {
    "1b": ("bench-1b", {}),
    "4096": ("bench-1b", dict(d_model=4096, n_layers=8, n_heads=32, n_kv_heads=8, ffn_dim=14336)),
    "smoke": ("tiny", dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)),
}
#: The 120M main-run shape of the first real-data study (experiments/results/doremi_real.md);
#: vocab: the quickstart BPE.
MODEL_120M = dict(d_model=896, n_layers=12, n_heads=14, n_kv_heads=14, ffn_dim=2432)
#: `model.fp8.layers` names -> plain_llama's linear of that role (`--fp8-layers` converts the same in both).
PLAIN_LINEARS = {"qkv": "wqkv", "proj": "wo", "gate_up": "w_gate_up", "down": "w_down"}
#: The variant suffix of a row whose LM head runs in FP8 too (`--with-head`).
WITH_HEAD = "+" + HEAD
#: Issue 36's acceptance of the training run: |FP8 / bf16 - 1| of the final validation loss.
VAL_TOLERANCE = 0.005


def plain_filter(layers: tuple[str, ...], head: bool = False) -> Callable[[torch.nn.Module, str], bool]:
    """torchao's `module_filter_fn` converting plain_llama's linears of the roles in `layers`, and
    the head (`output`) only with `head`: `convert_to_float8_training` without a filter converts
    it too; ours only with `head` in `model.fp8.layers` (opt in), so by default plain keeps it in bf16."""
    names = {PLAIN_LINEARS[name] for name in layers} | ({"output"} if head else set())
    return lambda _, fqn: fqn.rsplit(".", 1)[-1] in names


def inductor_settings(pairs: list[str]) -> dict[str, bool | int | float | str]:
    """`--inductor KEY=VALUE` as `torch._inductor.config` settings (true/false, numbers, else
    strings); an unknown key is a ValueError, before anything compiles."""
    import torch._inductor.config as inductor

    out: dict[str, bool | int | float | str] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not hasattr(inductor, key):
            raise ValueError(f"--inductor expects KEY=VALUE with a torch._inductor.config key, got {pair!r}")
        low = raw.lower()
        value: bool | int | float | str = raw
        if low in ("true", "false"):
            value = low == "true"
        else:
            for kind in (int, float):
                try:
                    value = kind(raw)
                    break
                except ValueError:
                    pass
        out[key] = value
    return out


def graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def compiled_row(build: Callable[[], Callable[[], dict]], label: str) -> dict:
    """A fresh dynamo state, then `build()` (which compiles and times a step): its row with the
    graph breaks counted on the way."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    counters.clear()
    row = build()()
    return {**row, "variant": label, "graph_breaks": graph_breaks()}


def ours(cfg: ModelConfig, args, device: torch.device, label: str) -> dict:
    from trainer.model.llama import Llama
    from trainer.parallel.context import ParallelContext

    def build() -> Callable[[], dict]:
        model = Llama(replace(cfg, compile=device.type == "cuda"), pc=ParallelContext.single(device))
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        # bf16 parameters on a GPU, as the trainer's `train.param_dtype: auto` resolves there (and
        # as plain's); the model compiles itself on CUDA only, on the CPU (smoke) the same graph.
        if device.type == "cuda":
            for param in model.parameters():
                param.data = param.data.to(dtype)
        step_model = model if device.type == "cuda" else torch.compile(model, backend="aot_eager")
        steps, warmup = args.steps, args.warmup
        return lambda: model_step_row(step_model, cfg, "", args.micro_batch, args.seq, steps, warmup, device, dtype)

    row = compiled_row(build, label)
    return {"part": "step", "model": "ours", **{k: v for k, v in row.items() if k not in ("part", "preset")}}


def plain_shape(cfg: ModelConfig, args) -> plain_llama.Shape:
    return plain_llama.Shape(
        vocab=cfg.vocab_size,
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads,
        ffn=cfg.ffn_dim,
        seq=args.seq,
        micro_batch=args.micro_batch,
    )


def plain(cfg: ModelConfig, args, device: torch.device, scaling: str | None, head: bool = False) -> dict:
    """plain_llama's step (bf16 parameters on a GPU, fp32 on the CPU), optionally through
    torchao's own module swap: the yardstick for what torchao gives without our layers. `head`:
    its head converted too (else as `--plain-head` says)."""
    shape = plain_shape(cfg, args)

    def build() -> Callable[[], dict]:
        torch.manual_seed(0)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = plain_llama.Llama(shape).to(device, dtype)
        if scaling is not None:
            from torchao.float8 import convert_to_float8_training

            fp8 = linear_config(*SCALINGS[scaling], emulate=not native_fp8(device))
            convert_to_float8_training(
                model, config=fp8, module_filter_fn=plain_filter(tuple(args.fp8_layers), head or args.plain_head)
            )
        opt = torch.optim.AdamW(model.parameters(), lr=plain_llama.LR, fused=device.type == "cuda")
        fwd = torch.compile(model, backend="inductor" if device.type == "cuda" else "aot_eager")
        gen = torch.Generator(device="cpu").manual_seed(0)
        ids = torch.randint(0, shape.vocab, (shape.micro_batch, shape.seq), generator=gen).to(device)

        def measure() -> dict:
            secs = sorted(
                timed(lambda: plain_llama.train_step(model, fwd, opt, ids, ids), args.steps, args.warmup, device)
            )
            median = secs[len(secs) // 2]
            return {"ms": median * 1e3, "tokens_per_s": shape.seq * shape.micro_batch / median}

        return measure

    label = (scaling or "bf16") + (WITH_HEAD if head else "")
    return {"part": "step", "model": "plain", **compiled_row(build, label)}


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row's tokens/s over its own model's bf16 row at the same size."""
    base = {(r["size"], r["model"]): r["tokens_per_s"] for r in rows if r["variant"] == "bf16" and "error" not in r}
    for r in rows:
        if "error" not in r and (r["size"], r["model"]) in base:
            r["ratio_vs_bf16"] = r["tokens_per_s"] / base[(r["size"], r["model"])]
    return rows


def bench_steps(args, device: torch.device) -> tuple[list[dict], bool]:
    rows: list[dict] = []
    ok = True
    for size, micro_batch in zip(args.sizes, micro_batches(args)):
        preset, overrides = SIZES[size]
        cfg = replace(model_config(preset=preset, **overrides), max_seq_len=max(args.seq, 16))
        heads = (True,) if args.only_with_head else (False, True) if args.with_head else (False,)
        a = argparse.Namespace(**{**vars(args), "micro_batch": micro_batch})
        parts: list[tuple[str, Callable[[], dict]]] = [("ours/bf16", lambda c=cfg, a=a: ours(c, a, device, "bf16"))]
        for s in args.scalings:
            for head in heads:
                layers = [*args.fp8_layers, *([HEAD] if head else [])]
                fp8 = replace(cfg, fp8=Fp8Config(scaling=SCALINGS[s][0], grad_dtype=SCALINGS[s][1], layers=layers))
                label = s + (WITH_HEAD if head else "")
                parts.append((f"ours/{label}", lambda c=fp8, label=label, a=a: ours(c, a, device, label)))
        parts.append(("plain/bf16", lambda c=cfg, a=a: plain(c, a, device, None)))
        parts += [
            (f"plain/{s}{WITH_HEAD if head else ''}", lambda c=cfg, s=s, head=head, a=a: plain(c, a, device, s, head))
            for s in args.scalings
            for head in heads
        ]
        for name, fn in parts:
            new: list[dict] = []
            ok &= run_part(new, f"{size}/{name}", lambda fn=fn: [fn()])
            model, variant = name.split("/")
            rows += [{"size": size, "micro_batch": micro_batch, "model": model, "variant": variant, **r} for r in new]
    return with_ratios(rows), ok


def micro_batches(args: argparse.Namespace) -> list[int]:
    """Each size's micro-batch: `--micro-batch` gives one for every size or one per size, so that
    one call can time each size at the micro-batch it fits (1b at 16, d_model 4096 at 4)."""
    given = args.micro_batch if isinstance(args.micro_batch, list) else [args.micro_batch]
    return given * len(args.sizes) if len(given) == 1 else list(given)


def step_table(rows: list[dict]) -> list[str]:
    lines = [f"{'size':6s} {'model':6s} {'variant':15s} {'ms':>9s} {'tokens/s':>10s} {'x bf16':>7s} {'breaks':>6s}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['size']:6s} {r['model']:6s} {r['variant']:15s} FAILED: {r['error']}")
            continue
        ratio = f"{r['ratio_vs_bf16']:7.3f}" if "ratio_vs_bf16" in r else " " * 7
        lines.append(
            f"{r['size']:6s} {r['model']:6s} {r['variant']:15s} {r['ms']:9.2f} {r['tokens_per_s']:10.0f} "
            f"{ratio} {r['graph_breaks']:6d}"
        )
    return lines


# -- the training run -----------------------------------------------------------------------------


def nonfinite_steps(rows: list[dict]) -> list[int]:
    """The logged steps whose loss or gradient norm is NaN or infinite (metrics.jsonl writes
    those as the strings "nan", "inf": `trainer.records.metrics`)."""
    return [
        r["step"]
        for r in rows
        if "loss" in r and not all(math.isfinite(float(r.get(k, 0.0))) for k in ("loss", "grad_norm"))
    ]


def train_run(args, device: torch.device, label: str, work: Path) -> dict:
    """One run of the 120M model on the quickstart data (`--smoke`: `--config`'s own model and
    data): its loss curve, validation curve and final validation loss (mean over domains), the
    non-finite steps, and its seconds (kept in the run directory, so a finished run read again
    gives the same row)."""
    import time

    from doremi.config import ExperimentConfig
    from doremi.pipeline import stages
    from trainer.config.schema import load_config
    from trainer.records.metrics import read_jsonl
    from trainer.run.health import NonFiniteError

    run = work / label
    sets = [
        f"train.device={device.type}",
        f"model.compile={'true' if device.type == 'cuda' else 'false'}",
        f"train.steps={args.train_steps}",
        f"train.eval_every={max(1, args.train_steps // 10)}",
        f"train.run_dir={run}",
        f"checkpoint.every={args.train_steps}",
        "checkpoint.keep=1",
        # every 10 steps on the GPU: each logged step reads the device; the trainer's health
        # check still stops at the first non-finite step, logged or not (`trainer.run.health`)
        f"logging.every={1 if args.smoke else 10}",
        "logging.progress=false",
        "data.domain_weights=tokens",
    ]
    if not args.smoke:
        seq = 512
        sets += [
            *(f"model.{k}={v}" for k, v in MODEL_120M.items()),
            f"model.max_seq_len={seq}",
            f"data.seq_len={seq}",
            f"data.store_dir={work / f'stores-{seq}'}",
            # the embedded corpus's smallest domain (notes) holds 82 sequences of 512 tokens, and
            # a holdout may take at most a quarter of a domain (data/sampling/holdout.py)
            "data.holdout_sequences=16",
            f"train.global_batch_size={args.train_batch}",
            "train.lr=1e-3",
            "train.min_lr=1e-4",
        ]
    if label != "bf16":
        scaling = SCALINGS[label.removesuffix(WITH_HEAD)]
        sets += [f"model.fp8.scaling={scaling[0]}", f"model.fp8.grad_dtype={scaling[1]}"]
        if label.endswith(WITH_HEAD):
            sets.append(f"model.fp8.layers=[{','.join([*FP8_LAYERS, HEAD])}]")
    cfg = load_config(args.config, sets, cls=ExperimentConfig)
    if not (Path(cfg.data.store_dir) / "manifest.json").exists():
        from data.preprocess.preprocess import preprocess

        preprocess(cfg.data, progress=False)
    metrics, facts = run / "metrics.jsonl", run / "fp8_bench_run.json"
    if not facts.exists():  # a finished run (an earlier call on the same machine) is read, not rerun
        start, stopped_at = time.perf_counter(), None
        try:
            stages.train(cfg)
        except NonFiniteError as e:
            stopped_at = e.step
        facts.write_text(json.dumps({"seconds": time.perf_counter() - start, "stopped_at": stopped_at}))
    done = json.loads(facts.read_text())
    rows = read_jsonl(metrics)
    curve = [(r["step"], float(r["loss"])) for r in rows if "loss" in r]
    val_curve = [
        (r["step"], sum(map(float, r["val_loss"].values())) / len(r["val_loss"])) for r in rows if "val_loss" in r
    ]
    bad = sorted({*nonfinite_steps(rows), *([done["stopped_at"]] if done["stopped_at"] else [])})
    final = val_curve[-1][1] if val_curve and not bad else math.nan
    return {
        "part": "train",
        "variant": label,
        "curve": curve,
        "val_curve": val_curve,
        "final_val_loss": final,
        "nonfinite_steps": bad,
        "finite": not bad and math.isfinite(final),
        "seconds": done["seconds"],
    }


def plot_curves(runs: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    for r in runs:
        steps, losses = zip(*r["curve"])
        line = ax.plot(steps, losses, label=f"{r['variant']} train", linewidth=0.8)[0]
        if r["val_curve"]:
            ax.plot(
                *zip(*r["val_curve"]),
                marker="o",
                markersize=3,
                linestyle="--",
                color=line.get_color(),
                label=f"{r['variant']} validation (final {r['final_val_loss']:.4f})",
            )
    ax.set_xlabel("step")
    ax.set_ylabel("loss (validation: mean over domains)")
    ax.set_title("120M on the quickstart data: bf16 against FP8 (torchao)")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")


def bench_train(args, device: torch.device, out: Path) -> tuple[list[dict], bool]:
    rows: list[dict] = []
    ok = True
    labels = [s + head for s in args.scalings for head in ("", *([WITH_HEAD] if args.with_head else []))]
    for label in ("bf16", *labels):
        ok &= run_part(rows, f"train/{label}", lambda label=label: [train_run(args, device, label, args.work)])
    done = [r for r in rows if "error" not in r]
    base = next((r for r in done if r["variant"] == "bf16"), None)
    for r in done:
        if base is not None:
            r["val_loss_vs_bf16"] = r["final_val_loss"] / base["final_val_loss"] - 1.0
            r["accepted"] = bool(abs(r["val_loss_vs_bf16"]) <= VAL_TOLERANCE and r["finite"] and base["finite"])
    if done:
        out.mkdir(parents=True, exist_ok=True)
        plot_curves(done, out / "fp8_train.png")
    return rows, ok


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", nargs="?", choices=["step", "train"], default="step")
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=["1b", "4096"])
    p.add_argument("--scalings", nargs="+", choices=list(SCALINGS), default=["tensorwise"])
    p.add_argument(
        "--fp8-layers",
        nargs="+",
        choices=list(PLAIN_LINEARS),
        default=list(PLAIN_LINEARS),
        help="step: the block linears in FP8, in ours (model.fp8.layers) and in plain",
    )
    p.add_argument(
        "--with-head",
        action="store_true",
        help="per scaling, one more row with the LM head in FP8 too: step, ours (model.fp8.layers + head) and "
        "plain; train, an arm",
    )
    p.add_argument(
        "--only-with-head",
        action="store_true",
        help="step: the FP8 rows only with the LM head in FP8 too (ours and plain): half the compiles of --with-head",
    )
    p.add_argument("--plain-head", action="store_true", help="step: plain's head in FP8 in every FP8 row (ours not)")
    p.add_argument(
        "--inductor",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="torch._inductor.config settings for the compiles",
    )
    p.add_argument(
        "--micro-batch", type=int, nargs="+", default=[4], help="step: one for every size, or one per --sizes entry"
    )
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--train-steps", type=int, default=2000)
    p.add_argument("--train-batch", type=int, default=8, help="train: sequences of 512 tokens per step")
    p.add_argument("--work", type=Path, default=ROOT / "runs/fp8_bench")
    p.add_argument("--config", type=Path, default=ROOT / "experiments/configs/quickstart.yaml", help="train's data")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="toy sizes on the CPU, FP8 emulated: not a result")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if len(args.micro_batch) not in (1, len(args.sizes)) or min(args.micro_batch) < 1:
        p.error(f"--micro-batch: one positive value, or one per size ({len(args.sizes)}), got {args.micro_batch}")
    if args.smoke:
        args.device, args.sizes, args.micro_batch, args.seq = "cpu", ["smoke"], [2], 32
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    device = torch.device(args.device)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    try:
        inductor = inductor_settings(args.inductor)
    except ValueError as e:
        p.error(str(e))
    for key, value in inductor.items():
        setattr(torch._inductor.config, key, value)
    native = native_fp8(device)
    out = args.out or args.work
    if args.mode == "step":
        rows, ok = bench_steps(args, device)
        lines = step_table(rows)
    else:
        rows, ok = bench_train(args, device, out)
        lines = [
            f"{r['variant']:10s} final val loss {r['final_val_loss']:.4f}, {r['seconds']:.0f} s"
            + (f" ({r['val_loss_vs_bf16']:+.2%} vs bf16)" if "val_loss_vs_bf16" in r else "")
            + ("" if r["finite"] else f"  NOT FINITE at steps {r['nonfinite_steps'][:5]}")
            + (f"; acceptance (within {VAL_TOLERANCE:.1%}, all finite): {r['accepted']}" if "accepted" in r else "")
            for r in rows
            if "error" not in r
        ]
    head = f"{args.mode} on {device} ({'torch._scaled_mm' if native else 'EMULATED: not a result'}), torch {torch.__version__}"
    print("\n".join([head, *lines]), flush=True)
    result = {"mode": args.mode, "device": str(device), "native_fp8": native, "torch": torch.__version__}
    result |= {"fp8_layers": args.fp8_layers, "plain_head": args.plain_head, "with_head": args.with_head}
    result |= {"inductor": inductor, "rows": rows}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"fp8_{args.mode}.json").write_text(json.dumps(result, indent=1))
    if not ok:
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
