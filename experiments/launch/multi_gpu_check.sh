#!/usr/bin/env bash
# Parity of the parallel layouts on real devices: per-step losses of tp2, pp2, dp2 (and the
# DoReMi proxy's alpha at tp2) against one device, fp32, through torchrun. On GPUs this is the
# NCCL path (async tensor parallel, batched p2p, ZeRO-1 broadcasts); on a CPU it runs on gloo.
#   OUT=runs/multi_gpu_check bash experiments/launch/multi_gpu_check.sh     (needs 2 devices or CPU)
set -euo pipefail
OUT=${OUT:-runs/multi_gpu_check}
CFG=experiments/configs/quickstart.yaml
PY=${PYTHON:-python3}
S=(--set "data.store_dir=$OUT/stores" --set train.steps=6 --set train.precision=fp32
   --set logging.progress=false --set train.eval_every=0 --set checkpoint.every=0
   --set train.decay=constant --set train.warmup_steps=0 --set train.micro_batches=4)
run2() { "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 -m doremi "$@"; }

"$PY" -m doremi preprocess "$CFG" "${S[@]}" > /dev/null
"$PY" -m doremi train "$CFG" "${S[@]}" --set train.run_dir="$OUT/single"
run2 train "$CFG" "${S[@]}" --set train.run_dir="$OUT/tp2" --set parallelism.tp=2 \
  --set parallelism.sequence_parallel=true --set parallelism.tp_async=true --set parallelism.tp_recompute_allgather=true
run2 train "$CFG" "${S[@]}" --set train.run_dir="$OUT/pp2" --set parallelism.pp=2 --set parallelism.pp_schedule=1f1b
run2 train "$CFG" "${S[@]}" --set train.run_dir="$OUT/dp2" --set parallelism.dp=2 --set parallelism.zero1=true
"$PY" -m doremi train-reference "$CFG" "${S[@]}" --set train.run_dir="$OUT/ref"
P=(--set mixing.doremi.reference="$OUT/ref")
"$PY" -m doremi train-proxy "$CFG" "${S[@]}" "${P[@]}" --set train.run_dir="$OUT/proxy"
run2 train-proxy "$CFG" "${S[@]}" "${P[@]}" --set train.run_dir="$OUT/proxy-tp2" --set parallelism.tp=2 \
  --set parallelism.sequence_parallel=true
run2 train-proxy "$CFG" "${S[@]}" "${P[@]}" --set train.run_dir="$OUT/proxy-pp2" --set parallelism.pp=2

"$PY" - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def rows(run, name):
    return [json.loads(l) for l in (out / run / name).read_text().splitlines()]
single = [r["loss"] for r in rows("single", "metrics.jsonl")]
for run in ("tp2", "pp2", "dp2"):
    got = [r["loss"] for r in rows(run, "metrics.jsonl")]
    print(f"{run:10s} max relative loss difference vs 1 device: {max(abs(a - b) / abs(a) for a, b in zip(single, got)):.2e}")
alpha = [r["weights"] for r in rows("proxy", "domain_weights.jsonl")]
for run in ("proxy-tp2", "proxy-pp2"):
    got = [r["weights"] for r in rows(run, "domain_weights.jsonl")]
    print(f"{run:10s} max |alpha difference| vs 1 device over {len(got)} steps: "
          f"{max(abs(x - y) for a, b in zip(alpha, got) for x, y in zip(a, b)):.2e}")
PY
