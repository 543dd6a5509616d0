#!/usr/bin/env bash
# The GPU-scale DoReMi experiment (issue 7) on one GPU: preprocess once, then one
# `doremi pipeline` per seed, all at the same time on the one device, sharing one store
# directory; then each seed's results packed as $OUT/gpu_scale_seed{N}.tar.gz (no checkpoints)
# beside its log $OUT/gpu_scale_seed{N}.log.
#
# Usage (from the repository root):
#   OUT=/some/dir bash experiments/launch/gpu_scale.sh [--seeds "1 2"] [--work runs/gpu_scale]
#       [--deadline SECONDS] [--config experiments/configs/gpu_scale.yaml] [--set KEY=VALUE ...]
#
# --set is passed to every pipeline (and to preprocess): `--set train.steps=N` sizes the
# reference and proxy, `--set pipeline.main.train.steps=M` the main runs.
# --deadline: stop the pipelines after this many seconds and pack what they finished (exit 3);
# run the same command again on the same machine to resume (finished stages are skipped,
# interrupted ones resume from their last checkpoint under --work). 0: no deadline.
# Exit status: 0 all seeds finished, 1 a seed failed, 2 bad usage, 3 stopped at the deadline.
set -euo pipefail

CONFIG=experiments/configs/gpu_scale.yaml
SEEDS="1 2"
WORK=runs/gpu_scale
DEADLINE=0
SETS=()
PYTHON=${PYTHON:-python3}
ARGS=("$@")

die() { echo "gpu_scale.sh: error: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --seeds) SEEDS=${2:?}; shift 2 ;;
    --work) WORK=${2:?}; shift 2 ;;
    --deadline) DEADLINE=${2:?}; shift 2 ;;
    --config) CONFIG=${2:?}; shift 2 ;;
    --set) SETS+=(--set "${2:?}"); shift 2 ;;
    *) die "unknown argument '$1' (expected --seeds, --work, --deadline, --config or --set)" ;;
  esac
done
[ -n "${OUT:-}" ] || die "OUT is not set (the directory the packed results go to)"
[ -f "$CONFIG" ] || die "$CONFIG: no such config (run from the repository root)"
[[ "$DEADLINE" =~ ^[0-9]+$ ]] || die "--deadline: expected whole seconds, got '$DEADLINE'"
for s in $SEEDS; do [[ "$s" =~ ^[0-9]+$ ]] || die "--seeds: expected integers, got '$s'"; done
[ -n "${SEEDS// }" ] || die "--seeds: expected at least one seed"

export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$WORK"
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }
STORE="$WORK/stores"

echo "gpu_scale: config $CONFIG, seeds $SEEDS, work dir $WORK, overrides: ${SETS[*]:-none}"
"$PYTHON" - <<'EOF' || true
import torch
dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
print(f"gpu_scale: torch {torch.__version__}, device {dev}")
EOF

echo "[$(elapsed)s] preprocess -> $STORE"
# pipefail: the pipe fails when preprocess does (the filter of its progress bar never does).
if ! "$PYTHON" -m doremi preprocess "$CONFIG" --set "data.store_dir=$STORE" "${SETS[@]}" 2>&1 \
    | tr '\r' '\n' | { grep -a -v -e '^preprocess: ' -e '^\s*$' || true; }; then
  echo "gpu_scale: preprocess failed" >&2
  exit 1
fi

# One pipeline per seed, each in its own process group (set -m) so that the deadline can stop
# it with every process it started (torch.compile workers) and nothing else.
set -m
declare -A PID
for s in $SEEDS; do
  log="$OUT/gpu_scale_seed$s.log"
  "$PYTHON" -m doremi pipeline "$CONFIG" --set "pipeline.run_dir=$WORK/seed$s" \
    --set "data.store_dir=$STORE" --set "train.seed=$s" --set "data.seed=$s" "${SETS[@]}" \
    >>"$log" 2>&1 &
  PID[$s]=$!
  echo "[$(elapsed)s] seed $s: pipeline started (pid ${PID[$s]}, log $log)"
done
set +m

# The last stage message and the last progress-bar state of a seed's log, on one line.
status() {
  local log="$OUT/gpu_scale_seed$1.log" stage bar
  stage=$(grep -a '^\[[0-9][0-9]:[0-9][0-9]\]' "$log" | tail -n 1 | cut -c1-70 || true)
  bar=$(tail -c 2000 "$log" | tr '\r' '\n' | grep -a -v '^\s*$' | tail -n 1 | cut -c1-90 || true)
  echo "seed $1: $stage | $bar"
}

alive() { kill -0 "$1" 2>/dev/null; }
STOPPED=0
while :; do
  running=0
  for s in $SEEDS; do alive "${PID[$s]}" && running=1; done
  [ $running = 1 ] || break
  if [ "$DEADLINE" -gt 0 ] && [ "$(elapsed)" -ge "$DEADLINE" ]; then
    echo "[$(elapsed)s] deadline of ${DEADLINE}s reached: stopping the pipelines"
    for s in $SEEDS; do alive "${PID[$s]}" && kill -TERM -- "-${PID[$s]}" 2>/dev/null || true; done
    STOPPED=1
    break
  fi
  sleep 5
  if [ $(( $(elapsed) % 30 )) -lt 5 ]; then
    for s in $SEEDS; do echo "[$(elapsed)s] $(status "$s")"; done
  fi
done

FAILED=0
for s in $SEEDS; do
  rc=0
  wait "${PID[$s]}" || rc=$?
  if [ $STOPPED = 1 ] && [ $rc -ne 0 ]; then
    echo "[$(elapsed)s] seed $s: stopped at the deadline (rerun to resume)"
  elif [ $rc -ne 0 ]; then
    echo "[$(elapsed)s] seed $s: FAILED (exit $rc); last lines of its log:" >&2
    tr '\r' '\n' <"$OUT/gpu_scale_seed$s.log" | grep -a -v '^\s*$' | tail -n 15 >&2
    FAILED=1
  else
    echo "[$(elapsed)s] seed $s: finished"
  fi
  # Pack: the run directory without checkpoints, the stores' manifest (entropies, token
  # counts), the log, and how it was run.
  run="$WORK/seed$s"
  mkdir -p "$run/stores"
  cp "$STORE/manifest.json" "$run/stores/manifest.json"
  tr '\r' '\n' <"$OUT/gpu_scale_seed$s.log" | grep -a -v '^\s*$' >"$run/pipeline.log" || true
  "$PYTHON" - "$run/run_info.json" "$s" "$rc" "$(elapsed)" "$CONFIG" "${ARGS[@]}" <<'EOF'
import json, shlex, subprocess, sys
import torch
path, seed, rc, wall, config, *args = sys.argv[1:]
sets = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--set"]
try:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
except OSError:
    commit = ""
info = {"seed": int(seed), "exit_status": int(rc), "script_elapsed_s": int(wall), "config": config,
        "command": "OUT=$OUT bash experiments/launch/gpu_scale.sh " + shlex.join(args),
        "overrides": sets, "commit": commit or None,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
open(path, "w").write(json.dumps(info, indent=1) + "\n")
EOF
  tar -czf "$OUT/gpu_scale_seed$s.tar.gz" --exclude=checkpoints --exclude='.*.tmp' \
    -C "$WORK" "seed$s"
  echo "[$(elapsed)s] seed $s: packed $OUT/gpu_scale_seed$s.tar.gz ($(du -h "$OUT/gpu_scale_seed$s.tar.gz" | cut -f1))"
done

if [ $FAILED = 1 ]; then echo "gpu_scale: a seed failed" >&2; exit 1; fi
if [ $STOPPED = 1 ]; then echo "gpu_scale: stopped at the deadline after $(elapsed)s; rerun to resume"; exit 3; fi
echo "gpu_scale: done in $(elapsed)s"
