"""Tokens/s per core of `doremi preprocess` against the tokenizers library's own `encode_batch` on
the same text (issue 42 acceptance), with 1 and 2 processes, interleaved on a shared machine.

    .venv/bin/python experiments/tools/preprocess_per_core.py --work /tmp/h5/percore --total-mb 50 \\
        --rounds 3 --json /tmp/h5/percore.json

The corpus is experiments/tools/pile_shaped.py's (22 zstd JSON-lines domains) and the config the
pile config with its paths changed and `num_proc` set to 1 or 2; the tokenizer is the Pile-shaped
recipe's (a BPE of 512 trained on the embedded corpus, as tests/test_pile_shaped.py builds it)
unless `--tokenizer` names another `tokenizer.json`. Each measurement runs in a fresh process
and times only the work, after the imports:

- `ours`: `data.preprocess.preprocess.preprocess(cfg, force=True)`: read and parse the files, split, encode,
  write the task parts, merge them into the stores, hash them, write the manifest;
- `encode_batch`: every document of the same files, read into memory first (not timed), then
  `Tokenizer.encode_batch(batch, add_special_tokens=False)` on batches of 256 documents (the
  build's read batch); with `--num-proc 2`, two forked processes encode alternate batches with
  the library's threads off, as the build's workers do.

CPU time is user + system of the measuring process, its threads and its reaped children
(`resource.getrusage`), so that per-core rates (tokens / CPU s) do not depend on what else the
machine runs; wall rates do. Tokens count the EOS after each document in both. The load average
(`os.getloadavg`, as `uptime` prints it) is recorded before each measurement. Rounds alternate
ours, encode_batch, ours, ... for each `num_proc`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BATCH = 256


def cpu_seconds(children: bool = True) -> tuple[float, float]:
    """(user, system) seconds of this process (all its threads) and of its reaped children."""
    usage = [resource.getrusage(resource.RUSAGE_SELF)]
    if children:
        usage.append(resource.getrusage(resource.RUSAGE_CHILDREN))
    return sum(u.ru_utime for u in usage), sum(u.ru_stime for u in usage)


def _since(start: tuple[float, float], children: bool = True) -> dict:
    user, system = (b - a for a, b in zip(start, cpu_seconds(children)))
    return {"cpu_s": user + system, "user_s": user, "sys_s": system}


def load_data_config(config: Path):
    from doremi.config import ExperimentConfig
    from trainer.config.schema import load_config

    return load_config(str(config), None, cls=ExperimentConfig).data


def read_texts(config: Path) -> list[str]:
    """Every document of the config's domain files, in order (the texts `ours` encodes)."""
    from data.sources.readers import open_binary

    cfg = load_data_config(config)
    texts = []
    for d in cfg.domains:
        for path in d.paths:
            with open_binary(path) as f:
                texts += [t for t in (json.loads(line)["text"] for line in f) if t.strip()]
    return texts


def measure_ours(config: Path) -> dict:
    from data.preprocess.preprocess import preprocess

    cfg = load_data_config(config)
    cpu, wall = cpu_seconds(), time.perf_counter()
    manifest = preprocess(cfg, force=True)  # progress lines as the CLI (progress=False imports datasets)
    wall, cpu = time.perf_counter() - wall, _since(cpu)
    tokens = sum(d.train.tokens + d.validation.tokens for d in manifest.domains)
    return {"tokens": tokens, "wall_s": wall} | cpu


def _encode_share(raw, batches: list[list[str]]) -> int:
    return sum(len(e) + 1 for b in batches for e in raw.encode_batch(b, add_special_tokens=False))


def _batches(config: Path, k: int = 0, n: int = 1) -> list[list[str]]:
    texts = read_texts(config)
    return [texts[i : i + BATCH] for i in range(0, len(texts), BATCH)][k::n]


def measure_encode_batch(config: Path, tokenizer: Path, num_proc: int) -> dict:
    """With num_proc > 1, each forked process reads the texts itself before the clock starts (a
    list inherited through fork would be copied page by page as its reference counts change,
    which is not the library's cost) and reports its own CPU time."""
    if num_proc > 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(tokenizer))
    if num_proc == 1:
        batches = _batches(config)
        cpu, wall = cpu_seconds(), time.perf_counter()
        tokens = _encode_share(raw, batches)
        return {"tokens": tokens, "wall_s": time.perf_counter() - wall} | _since(cpu)
    children = []
    for k in range(num_proc):
        (ready_r, ready_w), (go_r, go_w), (out_r, out_w) = os.pipe(), os.pipe(), os.pipe()
        if os.fork() == 0:
            batches = _batches(config, k, num_proc)
            os.write(ready_w, b"1")
            os.read(go_r, 1)
            cpu = cpu_seconds(children=False)
            row = {"tokens": _encode_share(raw, batches)} | _since(cpu, children=False)
            os.write(out_w, json.dumps(row).encode())
            os._exit(0)
        children.append((ready_r, go_w, out_r))
    for ready_r, _, _ in children:
        os.read(ready_r, 1)
    wall = time.perf_counter()
    for _, go_w, _ in children:
        os.write(go_w, b"1")
    rows = [json.loads(os.read(out_r, 1 << 16)) for _, _, out_r in children]
    wall = time.perf_counter() - wall
    for _ in children:
        os.wait()
    return {"tokens": sum(r["tokens"] for r in rows), "wall_s": wall} | {
        key: sum(r[key] for r in rows) for key in ("cpu_s", "user_s", "sys_s")
    }


def prepare(work: Path, total_mb: float, tokenizer: Path | None) -> tuple[Path, dict[int, Path]]:
    sys.path.insert(0, str(ROOT / "experiments" / "tools"))
    import pile_shaped

    corpus = work / "corpus"
    if not (corpus / "enron_emails.jsonl.zst").is_file():
        pile_shaped.write_corpus(corpus, int(total_mb * 1e6))
    if tokenizer is None:
        tokenizer = work / "tokenizer.json"
        if not tokenizer.is_file():
            from data.config import TokenizerConfig
            from data.sources.sources import read_embedded
            from data.tokenizer.tokenizer import build_tokenizer, save_tokenizer

            texts = read_embedded("docs") + read_embedded("code")
            save_tokenizer(build_tokenizer(TokenizerConfig(kind="bpe", vocab_size=512), iter(texts)), tokenizer)
    base = (ROOT / "experiments/configs/pile_280m.yaml").read_text()
    configs = {}
    for n in (1, 2):
        text = pile_shaped.rewrite_config(base, corpus, tokenizer, work / f"stores{n}", work / "runs")
        configs[n] = work / f"pile_np{n}.yaml"
        configs[n].write_text(text.replace("num_proc: 32", f"num_proc: {n}"))
    return tokenizer, configs


def run_one(args: argparse.Namespace, what: str, config: Path, tokenizer: Path, num_proc: int) -> dict:
    cmd = [sys.executable, __file__, "--one", what, "--config", str(config), "--tokenizer", str(tokenizer)]
    load = os.getloadavg()
    out = subprocess.run(cmd + ["--num-proc", str(num_proc)], check=True, capture_output=True, text=True).stdout
    row = json.loads(out.strip().splitlines()[-1])
    row |= {"what": what, "num_proc": num_proc, "load": [round(x, 2) for x in load]}
    row["per_core"] = row["tokens"] / row["cpu_s"]
    row["per_wall"] = row["tokens"] / row["wall_s"]
    print(
        f"{what:<12} num_proc {num_proc}  load {load[0]:5.2f}  tokens {row['tokens']:>11,}  wall {row['wall_s']:6.1f} s"
        f"  cpu {row['cpu_s']:6.1f} s (sys {row['sys_s']:4.1f})  {row['per_core'] / 1e6:.3f} M/s per core  {row['per_wall'] / 1e6:.3f} M/s wall",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/doremi_per_core"))
    ap.add_argument("--total-mb", type=float, default=50.0)
    ap.add_argument("--tokenizer", type=Path, help="tokenizer.json (default: the Pile-shaped recipe's BPE of 512)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-proc", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--one", choices=["ours", "encode_batch"], help=argparse.SUPPRESS)
    ap.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        n = args.num_proc[0]
        row = measure_ours(args.config) if args.one == "ours" else measure_encode_batch(args.config, args.tokenizer, n)
        print(json.dumps(row))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    tokenizer, configs = prepare(args.work, args.total_mb, args.tokenizer)
    rows = []
    for _ in range(args.rounds):
        for n in args.num_proc:
            for what in ("ours", "encode_batch"):
                rows.append(run_one(args, what, configs[n], tokenizer, n))
    summary = {}
    for n in args.num_proc:
        best = {
            w: max(r["per_core"] for r in rows if r["what"] == w and r["num_proc"] == n)
            for w in ("ours", "encode_batch")
        }
        summary[n] = best | {"ratio": best["ours"] / best["encode_batch"]}
        print(
            f"num_proc {n}: best per core ours {best['ours'] / 1e6:.3f} M/s, encode_batch "
            f"{best['encode_batch'] / 1e6:.3f} M/s, ratio {summary[n]['ratio']:.2f}"
        )
    if args.json:
        info = {"cpus": os.cpu_count(), "python": platform.python_version(), "rows": rows, "summary": summary}
        args.json.write_text(json.dumps(info, indent=2) + "\n")


if __name__ == "__main__":
    main()
