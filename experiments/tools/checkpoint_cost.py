"""What the checkpoint checksums cost: save + load of a model's checkpoint, with the XXH3-64 hashes and
without them (torch's own zip CRC back on, loads checking sizes only), interleaved, median.

    python experiments/tools/checkpoint_cost.py [CONFIG.yaml] [--reps N] [--set model.d_model=512 ...]

Builds the config's model and optimizer on CPU (one process), takes one optimizer step so that
the optimizer state exists, then times `save_checkpoint` and `load_checkpoint` (with optimizer
state, as a resume does) into a temporary run directory. Results: experiments/notes/CHECKPOINTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from data.atomic import atomic_path
from doremi.config import ExperimentConfig
from trainer.build import RunFacts, build_model
from trainer.checkpoint import checkpoint
from trainer.config.schema import load_config
from trainer.optim.build import build_optimizer
from trainer.parallel.context import ParallelContext


def _plain_save(path: Path, obj) -> dict:
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)
    return {"bytes": path.stat().st_size, checkpoint.HASH_KEY: "unchecked"}


class _PlainReader(checkpoint._Reader):
    """The reader before checksums: size check and a memory-mapped load."""

    def __init__(self, ck, meta):
        self.ck, self.files, self.cache = ck, meta["files"], {}

    def __call__(self, name):
        if name not in self.cache:
            self._check_size(name)
            self.cache[name] = torch.load(self.ck / name, map_location="cpu", mmap=True, weights_only=True)
        return self.cache[name]


@contextlib.contextmanager
def without_checksums() -> Iterator[None]:
    saved = checkpoint._save, checkpoint._Reader
    checkpoint._save, checkpoint._Reader = _plain_save, _PlainReader
    try:
        yield
    finally:
        checkpoint._save, checkpoint._Reader = saved


def trained_state(cfg, pc):
    facts = RunFacts.resolve(cfg, pc)
    model = build_model(cfg, pc, facts)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = build_optimizer(named, cfg.train, pc, False, param_dtype=facts.param_dtype)
    for _, p in named:
        p.grad = torch.randn_like(p) * 1e-3
    opt.step(1e-3)
    opt.zero_grad()
    return model, opt


def time_once(run_dir: Path, step: int, model, opt, pc) -> tuple[float, float]:
    t0 = time.perf_counter()
    checkpoint.save_checkpoint(run_dir, step, model, opt, pc, {"step": step}, keep=1)
    t1 = time.perf_counter()
    checkpoint.load_checkpoint(run_dir, model, opt, pc)
    return t1 - t0, time.perf_counter() - t1


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config", nargs="?", default="experiments/configs/quickstart.yaml")
    ap.add_argument("--reps", type=int, default=31)
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    cfg = load_config(args.config, ["train.device=cpu", *args.set], cls=ExperimentConfig)
    torch.manual_seed(0)
    pc = ParallelContext.single()
    model, opt = trained_state(cfg, pc)
    times: dict[str, list[tuple[float, float]]] = {"with": [], "without": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps + 2):  # two warm-up rounds
            for kind in ("with", "without") if rep % 2 else ("without", "with"):
                ctx = without_checksums() if kind == "without" else contextlib.nullcontext()
                with ctx:
                    t = time_once(Path(tmp) / kind, rep + 1, model, opt, pc)
                if rep >= 2:
                    times[kind].append(t)
        files = list(checkpoint.latest_checkpoint(Path(tmp) / "with").iterdir())
        size = sum(f.stat().st_size for f in files)
        crc = statistics.median(_timed(lambda: [checkpoint.file_hash(f) for f in files]) for _ in range(args.reps))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{args.config}: {n_params / 1e6:.2f}M parameters, checkpoint {size / 2**20:.1f} MiB, median of {args.reps}")
    med = {k: [statistics.median(t[i] for t in v) for i in (0, 1)] for k, v in times.items()}
    for i, what in enumerate(("save", "load")):
        w, wo = med["with"][i], med["without"][i]
        print(f"{what}: {wo * 1e3:.2f} ms without checksums, {w * 1e3:.2f} ms with ({(w / wo - 1) * 100:+.1f}%)")
    print(f"XXH3-64 of the checkpoint's files alone (what a load adds): {crc * 1e3:.2f} ms")
    tw, two = sum(med["with"]), sum(med["without"])
    print(f"save+load: {two * 1e3:.2f} ms without, {tw * 1e3:.2f} ms with ({(tw / two - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
