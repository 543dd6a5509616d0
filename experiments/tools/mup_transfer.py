"""muP transfer sweep (issue 36 item 3): does the best learning rate at one width stay best at another?

For each parametrization (standard; spectral muP with `model.mup.base_width`; on request
`mup-emb`, muP with u-muP's embedding lr, see `PARAMS`), each width and
each learning rate: the framework's Llama (`trainer.model.llama.Llama`, the config's depth,
heads and vocabulary, d_model = width, ffn_dim = 8/3 width rounded to 32) trained `--steps`
steps by the framework's optimizer (`trainer.optim.build_optimizer`: AdamW with the config's
betas and weight decay, muP's per-parameter learning rates through `_lr_scale`), on the
framework's schedule (`trainer.optim.lr_schedule.lr_at`: the config's warmup, then its decay to
lr / 10) with the config's gradient clipping; then the validation loss, mean over domains.
Under muP the best learning rate should be the same at every width (Yang et al. 2022, "Tensor
Programs V", Fig. 1); under the standard parametrization it drifts down as the width grows.

Why one process and not `doremi train` per run: the sweep (3 widths x 7 learning rates x 2
parametrizations) has to fit about four minutes of one GPU, and each trainer run pays its own
start-up (stores, compile, checkpoints, metrics files). Here the stores are preprocessed once,
the token streams sit on the device, and every run draws the same batches from the same init
seed: sequences of `--seq` + 1 tokens packed within each of `--domains`, drawn without
replacement from all their training sequences (the token-proportional mixture: on the small
embedded corpus it repeats the smallest domain least). Eager, not compiled (five compiles, one per width and
parametrization, would cost more than the runs); on a GPU bf16 autocast over fp32 parameters,
as the trainer's fp32-parameter runs (`trainer.build._autocast`). At the base width the muP
model is the standard one (r = 1, `trainer.model.mup`): those runs are made once and appear in
both tables. `--zero-init`: the muP arms start with a zero head and zero queries
(`model.mup.zero_init`, Tensor Programs V's recommendation), the standard arm as before; the
muP model at the base width then differs from the standard one, and each has its own runs there.

Outputs under `--out`: `mup_transfer.md` (the tables, the command, the time estimated from FLOPs
and the time taken; under each table the grid's best lr per width and the fitted optimum, the
vertex of the parabola in log2 lr through the best and its two neighbours, with its shift in
octaves: the first GPU sweep's muP best moved a whole grid point at width 1024 for a fitted
shift of 0.24 octave, because width 256's optimum, 0.00153, lay 0.12 octave above the middle of
0.001 and 0.002), `mup_transfer.json` (every run's loss curve, validation loss per domain and
seconds; rewritten after each run, so a sweep cut short keeps what finished) and
`mup_transfer.png` (validation loss against lr, one line per width, standard beside muP).
`--max-seconds`: start no run after that many seconds, and write the tables of the runs done;
the runs are also kept under `--work`, so the same command again on the same machine runs only
the rest, as long as the code is the same (`code_hash`: after a change to the trainer, such as
muP's weight-decay rule, a kept run would be stale, and every run is made again).

Usage (repository root; the config's stores are built first when missing):
    python experiments/tools/mup_transfer.py [--widths 256 512 1024] [--lrs 0.0005 0.001 ... 0.032] \\
        [--steps 500] [--batch 16] [--seq 128] [--base-width 256] [--domains code docs notes] \\
        [--max-seconds S] [--device cuda] [--config experiments/configs/quickstart.yaml] \\
        [--params standard mup [mup-emb]] [--zero-init] [--set key=value ...] [--work runs/mup_transfer] \\
        [--out DIR]

The defaults are the GPU sweep's. Learning rates: seven, a factor 2 apart (the standard
parametrization's best lr should fall about 4x from width 256 to 1024, two grid points, and the
grid has room on both sides of where width 256's best is expected, a few 1e-3). muTransfer
tunes at the base width and asks whether that lr stays best wider, so the grid to test it is
centred on width 256's optimum: after the first GPU sweep (fitted 0.00153), `--lrs 0.000375
0.00075 0.0015 0.003 0.006`, a point at the optimum and half an octave of room either side of
it before the argmin changes. Data: the
embedded text domains (code, docs, notes; 505k training tokens), not the quickstart's synthetic
ones, whose repeat and Markov domains are learnt in sudden drops: in a CPU sweep (widths 32 to
128, 200 steps) their validation losses moved by up to 1.5 nats between neighbouring learning
rates, against 0.1-0.5 for the text domains, and decided the best lr of the mean. Run length:
500 steps of 16 x 128 tokens, 1.0M tokens a run, about 2 passes over the training tokens (more
would measure memorisation). FLOPs: 17, 60 and 222 MFLOP a token at widths 256, 512 and 1024,
14 s for the 35 runs (the base width's 7 once) at 30% MFU of an H100; but the steps of these eager models are bound by launching kernels (about 725 operators
a step, counted on the CPU with the profiler: some 7 ms a step at 10 us each), so about
35 x 500 x 7 ms = 123 s, plus start-up, stores and evaluation.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from data.artifact import content_hash, file_hash  # noqa: E402
from data.errors import UserError  # noqa: E402
from doremi.config import ExperimentConfig  # noqa: E402
from trainer.config.mup import MupConfig  # noqa: E402
from trainer.config.schema import load_config  # noqa: E402
from trainer.model.flops import flops_per_token  # noqa: E402

#: Parametrizations: "mup-emb" is muP with the embedding's Adam lr x 1 / sqrt(r) (u-muP's rule,
#: Blake et al. 2024, arXiv:2407.17465, "A new embedding LR rule": muP's width-independent
#: embedding lr transferred poorly in their Llama runs), an experiment of this tool only.
PARAMS = ("standard", "mup", "mup-emb")
DEFAULT_PARAMS = ("standard", "mup")
#: The quickstart's embedded text domains (data/corpus): the sweep's default data.
TEXT_DOMAINS = ("code", "docs", "notes")
#: H100 SXM dense bf16 peak (as experiments/tools/bench/timing.py) and the utilisation the time
#: estimate assumes: small eager models reach less, so the estimate is a floor (see `estimate_seconds`).
PEAK_BF16 = 989e12
ESTIMATE_MFU = 0.30
#: The source whose bytes decide a run's numbers (`code_hash`): the trainer (model, optimizer,
#: schedule, muP), `data/` (the stores the tokens are read from) and this tool.
CODE = ("trainer", "data", "experiments/tools/mup_transfer.py")


class SweepError(UserError, ValueError):
    """A sweep that cannot run as asked (a width the heads do not divide, an empty grid)."""


@dataclass(frozen=True)
class Sweep:
    """What one sweep trains: the grid, and the run length every point shares."""

    widths: tuple[int, ...]
    lrs: tuple[float, ...]
    steps: int
    batch: int
    seq: int
    base_width: int
    params: tuple[str, ...] = DEFAULT_PARAMS
    seed: int = 0
    val_sequences: int = 128  # per domain, at most
    domains: tuple[str, ...] = ()  # trained and evaluated on; empty: all the stores'
    curve_every: int = 10  # the loss curve keeps the mean of each window of this many steps
    zero_init: bool = False  # the muP arms with `model.mup.zero_init` (zero head and queries)


@dataclass
class RunResult:
    param: str
    width: int
    lr: float
    val_loss: float  # mean over domains; inf when a loss was not finite
    val_per_domain: dict[str, float]
    curve: list[float]  # training loss, mean of each `curve_every` steps
    seconds: float
    finite: bool
    shared: bool = False  # the base-width run, the same model under every parametrization
    extra: dict = field(default_factory=dict)


def code_hash(root: Path = ROOT, paths: tuple[str, ...] = CODE) -> str:
    """One hash of the Python files under `paths` (each file's bytes through `data.artifact`'s
    `file_hash`, then `content_hash` of the names and hashes): the key, besides the sweep and the
    setup, under which an earlier call's runs kept in `--work` are reused."""
    files: list[Path] = []
    for name in paths:
        path = root / name
        files += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return content_hash({f.relative_to(root).as_posix(): file_hash(f) for f in files})


def ffn_dim(width: int) -> int:
    return max(32, round(8 * width / 3 / 32) * 32)


def check_sweep(sweep: Sweep, n_heads: int) -> None:
    if not sweep.widths or not sweep.lrs or sweep.steps < 1 or sweep.batch < 1 or sweep.seq < 1:
        raise SweepError("mup_transfer: --widths and --lrs need values; --steps, --batch and --seq >= 1")
    bad = [w for w in sweep.widths if w % n_heads]
    if bad:
        raise SweepError(f"mup_transfer: every width must be a multiple of model.n_heads={n_heads}, got {bad}")
    if any(lr <= 0 for lr in sweep.lrs):
        raise SweepError(f"mup_transfer: learning rates must be > 0, got {list(sweep.lrs)}")


def model_config(base, width: int, param: str, sweep: Sweep):
    """The sweep's model at `width`: `base` (the config's model) with d_model, ffn_dim, muP,
    eager, and room for `sweep.seq` tokens."""
    if param == "mup-emb" and base.tie_embeddings:
        raise SweepError(
            "mup_transfer: --params mup-emb scales the embedding's lr, which tied embeddings share with the head"
        )
    mup = MupConfig(base_width=sweep.base_width, zero_init=sweep.zero_init) if param != "standard" else None
    if mup is not None:
        mup.validate("model.mup", base.tie_embeddings)
    return replace(
        base,
        d_model=width,
        ffn_dim=ffn_dim(width),
        mup=mup,
        compile=False,
        max_seq_len=max(base.max_seq_len, sweep.seq),
    )


def embedding_lr_multiplier(param: str, width: int, sweep: Sweep) -> float:
    """The embedding's lr multiplier on top of muP's (1 there): 1 / sqrt(r) for "mup-emb"."""
    return (width / sweep.base_width) ** -0.5 if param == "mup-emb" else 1.0


def train_config(base, lr: float, sweep: Sweep):
    return replace(base, lr=lr, min_lr=lr / 10, steps=sweep.steps, global_batch_size=sweep.batch, micro_batches=1)


def base_run(param: str, sweep: Sweep) -> str:
    """The parametrization whose base-width run stands for `param`'s: at r = 1 every one is the
    same model (the first of `sweep.params`), except that with `sweep.zero_init` the muP arms
    (zero head and queries) differ from the standard one, and share the first muP arm's."""
    if sweep.zero_init:
        return param if param == "standard" else next(p for p in sweep.params if p != "standard")
    return sweep.params[0]


def runs_to_make(sweep: Sweep) -> list[tuple[str, int, float]]:
    """(parametrization, width, lr) of every run, width by width; at the base width the runs of
    parametrizations that are the same model there are made once (`base_run`)."""
    return [
        (param, w, lr)
        for w in sweep.widths
        for lr in sweep.lrs
        for param in sweep.params
        if not (w == sweep.base_width and param != base_run(param, sweep))
    ]


def estimate_seconds(model_cfgs: list, sweep: Sweep, peak: float = PEAK_BF16, mfu: float = ESTIMATE_MFU) -> float:
    """Training FLOPs of the given runs (`trainer.model.flops.flops_per_token`: 6N + attention)
    at `mfu` of `peak`. A floor for small eager models, whose steps are bound by kernel launches
    rather than FLOPs (the md reports the time taken beside it)."""
    tokens = sweep.steps * sweep.batch * sweep.seq
    return sum(flops_per_token(c, sweep.seq) for c in model_cfgs) * tokens / (peak * mfu)


# -- data -------------------------------------------------------------------------------------


@dataclass
class Tokens:
    """The stores' token streams on the device: every training sequence's start in `train`,
    and per domain a [n, seq + 1] block of validation sequences."""

    train: torch.Tensor
    starts: torch.Tensor
    val: dict[str, torch.Tensor]


def packed_starts(lengths: list[int], seq: int) -> list[int]:
    """Starts of the non-overlapping windows of seq + 1 tokens (consecutive windows share one
    token, as `data.store.dataset.PackedDomains`) within each of the concatenated streams of `lengths`."""
    starts, offset = [], 0
    for n in lengths:
        starts += [offset + i * seq for i in range(max(n - 1, 0) // seq)]
        offset += n
    return starts


def batch_order(n_sequences: int, steps: int, batch: int, seed: int) -> torch.Tensor:
    """[steps, batch] sequence indices: shuffled passes over all sequences (each seen once per
    pass), the same for every run of the sweep."""
    gen = torch.Generator().manual_seed(seed)
    need = steps * batch
    passes = [torch.randperm(n_sequences, generator=gen) for _ in range(-(-need // n_sequences))]
    return torch.cat(passes)[:need].view(steps, batch)


def load_tokens(cfg: ExperimentConfig, sweep: Sweep, device: torch.device) -> Tokens:
    import numpy as np

    from data.preprocess.preprocess import preprocess
    from data.store.store import open_stores

    if not (Path(cfg.data.store_dir) / "manifest.json").exists():
        preprocess(cfg.data, progress=False)
    stores = open_stores(cfg.data.store_dir)
    unknown = [d for d in sweep.domains if d not in stores.domains]
    if unknown:
        raise SweepError(f"mup_transfer: --domains {unknown} not in the stores' {stores.domains}")
    domains = list(sweep.domains) or stores.domains
    streams = [np.asarray(stores.tokens(d, "train"), dtype=np.int64) for d in domains]
    train = torch.from_numpy(np.concatenate(streams)).to(device)
    starts = torch.tensor(packed_starts([len(s) for s in streams], sweep.seq), dtype=torch.int64, device=device)
    if len(starts) == 0:
        raise SweepError(f"mup_transfer: no training sequence of --seq {sweep.seq} + 1 tokens in {cfg.data.store_dir}")
    val = {}
    for d in domains:
        stream = torch.from_numpy(np.asarray(stores.tokens(d, "validation"), dtype=np.int64))
        s = packed_starts([len(stream)], sweep.seq)[: sweep.val_sequences]
        if s:
            val[d] = torch.stack([stream[i : i + sweep.seq + 1] for i in s]).to(device)
    return Tokens(train=train, starts=starts, val=val)


def gather(tokens: torch.Tensor, starts: torch.Tensor, seq: int) -> dict[str, torch.Tensor]:
    rows = tokens[starts[:, None] + torch.arange(seq + 1, device=tokens.device)]
    return {"input_ids": rows[:, :-1], "labels": rows[:, 1:]}


# -- one run ----------------------------------------------------------------------------------


def autocast(device: torch.device):
    """bf16 autocast over fp32 parameters on a GPU (the trainer's `_autocast`); fp32 elsewhere."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def validation_loss(model, val: dict[str, torch.Tensor], device: torch.device) -> dict[str, float]:
    out = {}
    for domain, rows in val.items():
        with autocast(device):
            out[domain] = model(None, {"input_ids": rows[:, :-1], "labels": rows[:, 1:]}).float().mean().item()
    return out


def train_one(
    cfg: ExperimentConfig,
    sweep: Sweep,
    data: Tokens,
    order: torch.Tensor,
    param: str,
    width: int,
    lr: float,
    device: torch.device,
) -> RunResult:
    """One point of the grid: init from `sweep.seed`, `sweep.steps` steps over `order`'s batches."""
    from trainer.model.llama import Llama
    from trainer.optim.build import build_optimizer
    from trainer.optim.lr_schedule import lr_at
    from trainer.parallel.context import ParallelContext

    start = time.perf_counter()
    pc = ParallelContext.single(device)
    model = Llama(model_config(cfg.model, width, param, sweep), pc=pc, seed=sweep.seed).to(device)
    model.embed.weight._lr_scale = embedding_lr_multiplier(param, width, sweep)
    tcfg = train_config(cfg.train, lr, sweep)
    opt = build_optimizer(list(model.named_parameters()), tcfg, pc, zero1=False)
    losses = torch.zeros(sweep.steps, device=device)
    finite = True
    for step in range(sweep.steps):
        with autocast(device):
            loss = model(None, gather(data.train, data.starts[order[step]], sweep.seq)).mean()
        loss.backward()
        opt.clip_grad_norm(tcfg.grad_clip)
        opt.step(lr_at(step + 1, tcfg))
        opt.zero_grad()
        losses[step] = loss.detach()
        if (step + 1) % 100 == 0 and not torch.isfinite(losses[step]).item():
            finite = False  # the rest of a diverged run would only cost time
            break
    val = validation_loss(model, data.val, device)
    curve = losses[: (step + 1) // sweep.curve_every * sweep.curve_every].view(-1, sweep.curve_every).mean(1)
    finite = finite and all(math.isfinite(v) for v in val.values()) and bool(torch.isfinite(losses).all())
    mean = sum(val.values()) / len(val) if finite else math.inf
    if device.type == "cuda":
        torch.cuda.synchronize()
    return RunResult(param, width, lr, mean, val, curve.tolist(), time.perf_counter() - start, finite)


# -- the report -------------------------------------------------------------------------------


def grid(results: list[RunResult], sweep: Sweep) -> dict[str, dict[tuple[int, float], float]]:
    """param -> (width, lr) -> validation loss, a base-width run filled into the tables of every
    parametrization it stands for (`base_run`)."""
    out: dict[str, dict[tuple[int, float], float]] = {p: {} for p in sweep.params}
    for r in results:
        out[r.param][(r.width, r.lr)] = r.val_loss
        if r.width == sweep.base_width:
            for p in sweep.params:
                if base_run(p, sweep) == r.param:
                    out[p][(r.width, r.lr)] = r.val_loss
    return out


def best_lrs(losses: dict[tuple[int, float], float], widths, lrs) -> dict[int, float]:
    """Each width's learning rate of least loss, among widths whose every lr ran."""
    return {w: min(lrs, key=lambda lr: losses[(w, lr)]) for w in widths if all((w, lr) in losses for lr in lrs)}


def fitted_optimum(losses: dict[float, float]) -> float | None:
    """The lr at the vertex of the parabola in log2(lr) through the grid's best point and its two
    neighbours (`losses`: lr -> loss of one width). Where between grid points the optimum lies:
    an optimum near the middle of two points flips the grid's argmin a whole step when it moves
    a little, so the grid alone cannot tell a shift of 0.1 octave from one of 1. None when the
    best is at the grid's edge (not bracketed) or a neighbour diverged."""
    lrs = sorted(losses)
    i = min(range(len(lrs)), key=lambda j: losses[lrs[j]])
    if i in (0, len(lrs) - 1):
        return None
    x0, x1, x2 = (math.log2(lrs[j]) for j in (i - 1, i, i + 1))
    y0, y1, y2 = (losses[lrs[j]] for j in (i - 1, i, i + 1))
    if not all(math.isfinite(y) for y in (y0, y1, y2)):
        return None
    den = (x1 - x0) * (y1 - y2) - (x1 - x2) * (y1 - y0)
    if den == 0:
        return None
    return 2 ** (x1 - 0.5 * ((x1 - x0) ** 2 * (y1 - y2) - (x1 - x2) ** 2 * (y1 - y0)) / den)


def table(results: list[RunResult], sweep: Sweep) -> list[str]:
    lines = []
    for param, losses in grid(results, sweep).items():
        best = best_lrs(losses, sweep.widths, sweep.lrs)
        lines += [f"**{param}**", "", "| lr | " + " | ".join(f"width {w}" for w in sweep.widths) + " |"]
        lines.append("|---|" + "---|" * len(sweep.widths))
        for lr in sweep.lrs:
            cells = []
            for w in sweep.widths:
                v = losses.get((w, lr))
                cell = "not run" if v is None else "diverged" if not math.isfinite(v) else f"{v:.4f}"
                cells.append(f"**{cell}**" if best.get(w) == lr else cell)
            lines.append(f"| {lr:g} | " + " | ".join(cells) + " |")
        if best:
            first = best[min(best)]
            shifts = ", ".join(f"{s:+.2f}" for s in (math.log2(b / first) for b in best.values()))
            lines += ["", f"best lr per width: {', '.join(f'{w}: {b:g}' for w, b in best.items())} "]
            lines += [
                f"(log2 shift from width {min(best)}: {shifts}); the same at every width: "
                f"{'yes' if len(set(best.values())) == 1 else 'no'}",
                "",
            ]
            lines += [fitted_line({w: fitted_optimum({lr: losses[(w, lr)] for lr in sweep.lrs}) for w in best}), ""]
    return lines


def fitted_line(fitted: dict[int, float | None]) -> str:
    """The `fitted_optimum` of each width and its shift in octaves from the narrowest width's."""
    cells = ", ".join(f"{w}: {f:.3g}" if f else f"{w}: not bracketed" for w, f in fitted.items())
    first = fitted[min(fitted)]
    line = f"fitted optimum (parabola in log2 lr through the best and its neighbours) per width: {cells}"
    if first is None:
        return line
    shifts = ", ".join(f"{math.log2(f / first):+.2f}" if f else "-" for f in fitted.values())
    return f"{line} (octaves from width {min(fitted)}: {shifts})"


def plot(results: list[RunResult], sweep: Sweep, path: Path) -> None:
    from matplotlib.figure import Figure

    losses = grid(results, sweep)
    fig = Figure(figsize=(5 * len(losses), 4))
    axes = fig.subplots(1, len(losses), sharey=True, squeeze=False)[0]
    finite = [v for g in losses.values() for v in g.values() if math.isfinite(v)]
    for ax, (param, g) in zip(axes, losses.items()):
        best = best_lrs(g, sweep.widths, sweep.lrs)
        for w in sweep.widths:
            pts = [(lr, g[(w, lr)]) for lr in sweep.lrs if math.isfinite(g.get((w, lr), math.inf))]
            if not pts:
                continue
            line = ax.plot(*zip(*pts), marker="o", markersize=3, label=f"width {w}")[0]
            if w in best and math.isfinite(g[(w, best[w])]):
                ax.plot([best[w]], [g[(w, best[w])]], marker="*", markersize=14, color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_xticks(sweep.lrs, labels=[f"{lr:g}" for lr in sweep.lrs], rotation=45)
        ax.minorticks_off()
        ax.set_xlabel("learning rate (base)")
        ax.set_title(f"{param}: best lr\n" + ", ".join(f"{b:g} (w {w})" for w, b in best.items()), fontsize=9)
        ax.legend()
    axes[0].set_ylabel("validation loss (mean over domains)")
    if finite:
        axes[0].set_ylim(min(finite) - 0.05, min(max(finite), min(finite) + 2.0) + 0.05)
    fig.suptitle(f"muP transfer: {sweep.steps} steps of {sweep.batch} x {sweep.seq} tokens (star: best lr)")
    fig.savefig(path, dpi=120, bbox_inches="tight")


def write_outputs(out: Path, results: list[RunResult], sweep: Sweep, head: dict, final: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    data = {**head, "sweep": asdict(sweep), "runs": [asdict(r) for r in results]}
    (out / "mup_transfer.json").write_text(json.dumps(data, indent=1))
    if not final:
        return
    lines = [
        "# muP transfer sweep (quickstart data)",
        "",
        f"Command: `{head['command']}` on {head['device']}: {head['seconds']:.0f} s for "
        f"{len(results) - head.get('reused', 0)} runs ({head.get('reused', 0)} more from an earlier call) "
        f"(estimated from FLOPs at {ESTIMATE_MFU:.0%} MFU of an H100: {head['estimate_s']:.0f} s). "
        f"Validation loss, mean over domains, after {sweep.steps} steps of {sweep.batch} x {sweep.seq} tokens; "
        f"bold: the best learning rate of each width; base width {sweep.base_width}"
        f"{'; muP arms with zero init of the head and the queries (model.mup.zero_init)' if sweep.zero_init else ''}.",
        "",
        *table(results, sweep),
    ]
    (out / "mup_transfer.md").write_text("\n".join(lines) + "\n")
    plot(results, sweep, out / "mup_transfer.png")


def earlier_runs(state: Path | None, sweep: Sweep, setup: dict | None, code: str | None) -> list[RunResult]:
    """The runs that an earlier call of the same sweep (grid, run length, config, device) with the
    same code (`code_hash`) left in `state` before it was cut short; none when anything differs."""
    if state is None or not state.exists():
        return []
    data = json.loads(state.read_text())
    if data.get("sweep") != json.loads(json.dumps(asdict(sweep))) or data.get("setup") != setup:
        return []
    if data.get("code") != code:
        return []
    return [RunResult(**r) for r in data["runs"]]


def sweep_runs(
    cfg: ExperimentConfig,
    sweep: Sweep,
    device: torch.device,
    out: Path | None,
    head: dict,
    max_seconds: float | None = None,
    work: Path | None = None,
) -> list[RunResult]:
    """Every run of `runs_to_make` in this process (until `max_seconds`), the outputs rewritten
    after each; with `work`, the runs are also kept in `work/mup_transfer.json`, and those an
    earlier call of the same sweep kept there are not run again (a sweep cut short by a time
    limit is finished by the same command on the same machine, with the same code)."""
    check_sweep(sweep, cfg.model.n_heads)
    t0 = time.perf_counter()
    state = work / "mup_transfer.json" if work is not None else None
    head["code"] = code_hash()
    results = earlier_runs(state, sweep, head.get("setup"), head["code"])
    head["reused"] = len(results)
    done = {(r.param, r.width, r.lr) for r in results}
    data = load_tokens(cfg, sweep, device)
    order = batch_order(len(data.starts), sweep.steps, sweep.batch, sweep.seed).to(device)
    for param, w, lr in runs_to_make(sweep):
        if (param, w, lr) in done:
            continue
        if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
            print(f"--max-seconds {max_seconds:g} reached: {param} width {w} lr {lr:g} and after not run", flush=True)
            break
        r = train_one(cfg, sweep, data, order, param, w, lr, device)
        r.shared = w == sweep.base_width and sum(base_run(p, sweep) == param for p in sweep.params) > 1
        results.append(r)
        print(f"{param} width {w} lr {lr:g}: {r.val_loss:.4f} ({r.seconds:.1f} s)", flush=True)
        for folder in (out, work):
            if folder is not None:
                write_outputs(folder, results, sweep, {**head, "seconds": time.perf_counter() - t0}, final=False)
    head["seconds"] = time.perf_counter() - t0
    if out is not None:
        write_outputs(out, results, sweep, head, final=True)
    return results


def main(argv: list[str] | None = None) -> list[RunResult]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=ROOT / "experiments/configs/quickstart.yaml")
    p.add_argument("--widths", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--lrs", type=float, nargs="+", default=[0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--base-width", type=int, default=256)
    p.add_argument("--params", nargs="+", default=list(DEFAULT_PARAMS), choices=PARAMS)
    p.add_argument("--seed", type=int, default=0, help="init and batch order, the same for every run")
    p.add_argument("--zero-init", action="store_true", help="muP arms with model.mup.zero_init (zero head and queries)")
    p.add_argument("--val-sequences", type=int, default=128, help="validation sequences per domain, at most")
    p.add_argument(
        "--domains", nargs="*", default=list(TEXT_DOMAINS), help="trained and evaluated on (none given: every domain)"
    )
    p.add_argument("--max-seconds", type=float, default=None, help="start no run after this many seconds")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--set", nargs="*", default=[], help="further config overrides, key=value")
    p.add_argument("--out", type=Path, default=None, help="directory for mup_transfer.{md,json,png}")
    p.add_argument(
        "--work", type=Path, default=Path("runs/mup_transfer"), help="finished runs kept for a call cut short"
    )
    args = p.parse_args(argv)
    sweep = Sweep(
        widths=tuple(args.widths),
        lrs=tuple(args.lrs),
        steps=args.steps,
        batch=args.batch,
        seq=args.seq,
        base_width=args.base_width,
        params=tuple(dict.fromkeys(args.params)),
        seed=args.seed,
        val_sequences=args.val_sequences,
        domains=tuple(args.domains),
        zero_init=args.zero_init,
    )
    device = torch.device(args.device)
    try:
        cfg = load_config(args.config, args.set, cls=ExperimentConfig)
        check_sweep(sweep, cfg.model.n_heads)
        cfgs = [model_config(cfg.model, w, param, sweep) for param, w, _ in runs_to_make(sweep)]
        head = {
            "command": "python experiments/tools/mup_transfer.py "
            + shlex.join(argv if argv is not None else sys.argv[1:]),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
            "torch": torch.__version__,
            "estimate_s": estimate_seconds(cfgs, sweep),
        }
        head["setup"] = {
            "config": str(args.config),
            "config_hash": file_hash(args.config),
            "set": list(args.set),
            "device": head["device"],
        }
        print(
            f"{len(cfgs)} runs; estimated {head['estimate_s']:.0f} s at {ESTIMATE_MFU:.0%} MFU of an H100", flush=True
        )
        results = sweep_runs(cfg, sweep, device, args.out, head, args.max_seconds, args.work)
    except UserError as e:
        print(f"mup_transfer: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print("\n".join(table(results, sweep)))
    return results


if __name__ == "__main__":
    main()
