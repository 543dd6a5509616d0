#!/usr/bin/env bash
# The GPU measurements pending since sessions without a device, as device-tool calls of at most
# 600 s each. A session has 30 device minutes, counted from asking for the machine (a start of a
# minute or more, again after any gap of more than 30 s between calls) until it is given back:
# the three calls' limits (510 + 470 + 530 s) leave about 290 s for starts and transfers.
# Every bench writes under $OUT (the only folder that comes back from the device machine) and
# its log is teed there; each runs under its own timeout so a slow one cannot starve the next.
#
#   bash experiments/tools/bench/gpu_queue.sh 1   # issue 20: mixing methods' step cost at 1B
#   bash experiments/tools/bench/gpu_queue.sh 2   # issue 21: 64 stacked runs vs 8 one by one
#   (FP8, issue 36: its own call, which installs torchao first: experiments/notes/FP8.md)
#   bash experiments/tools/bench/gpu_queue.sh 3   # issue 24: MoE vs a plain loop; issue 25: Mamba-2, 1B hybrid
#   bash experiments/tools/bench/gpu_queue.sh 4   # issue 20 at 280M (the next session: both presets'
#                                                 # compiles of five variants do not fit one call)
#   bash experiments/tools/bench/gpu_queue.sh --print N   # the commands of call N, not run
#
# Then the comparison study (experiments/notes/COMPARISON.md), repeated until done:
#   python3 experiments/launch/doremi_real.py --out $OUT --work runs/compare --arms compare-s1,compare-s2 --deadline 580
set -u
PY=${PYTHON:-python3}
B=experiments/tools/bench

commands() {
    case "$1" in
    1) echo "method_bench 510 $PY $B/method_bench.py --presets 1b --deadline 480 --out \$OUT/method_bench" ;;
    4) echo "method_bench 510 $PY $B/method_bench.py --presets 280m --deadline 480 --out \$OUT/method_bench" ;;
    2)
        echo "stacked_bench 220 $PY $B/stacked_bench.py --device cuda --compile --models 64 --single 8"
        ;;
    3)
        echo "moe_bench 240 $PY $B/moe_bench.py --preset moe-1b-active --micro-batch 4 --seq 2048 --steps 10 --warmup 3 --out \$OUT/moe_bench"
        echo "mamba_bench 290 $PY $B/mamba_bench.py --preset hybrid-1b --micro-batch 4 --seq 2048 --steps 10 --warmup 3 --out \$OUT/mamba_bench"
        ;;
    *)
        echo "gpu_queue.sh: expected a call number 1, 2, 3 or 4, got '$1'" >&2
        return 2
        ;;
    esac
}

if [ "${1:-}" = "--print" ]; then
    commands "${2:-}"
    exit $?
fi
: "${OUT:?gpu_queue.sh: set OUT to the folder that comes back (the device tool sets it)}"
list=$(commands "${1:-}") || exit 2
status=0
while read -r name limit cmd; do
    cmd=${cmd//\$OUT/$OUT}
    echo "== $name (at most $limit s): $cmd"
    mkdir -p "$OUT"
    timeout "$limit" $cmd 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc"
    [ "$rc" = 0 ] || status=1
done <<<"$list"
exit $status
