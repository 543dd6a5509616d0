#!/usr/bin/env bash
# The GPU measurements still pending, as device-tool calls of at most 600 s each. The eleventh
# session ran 8, 2, 5, 6, 7 and call 1's MoE step (experiments/results/gpu_session11); the twelfth
# spent its device time on the study's pooled arm (experiments/results/doremi_study.md); the
# thirteenth ran the MoE layer, ODM/ADO/Aioli with DoGE's one pass, FP8 at micro-batch 16 with the
# head and call 3 (experiments/results/gpu_session13); the fourteenth 4 (DoGE's one pass after the
# skinny kernels) and 10 (FP8's two sizes in one run: issue 36 met; experiments/results/gpu_session14);
# the fifteenth 4 (every method's row in one run: DoReMi FP8 0.781, DoGE's one pass 0.784;
# experiments/results/gpu_session15); the sixteenth 4 (DoGE 0.802; experiments/results/gpu_session16;
# 11 stopped at a bench bug, since fixed); the seventeenth got no machine (about fifteen starts refused);
# the eighteenth, after about twelve refused starts, a lean 13 (DoGE 0.846, every other floor met;
# experiments/results/gpu_session18; test_gpu.py's compile checks used its 80 s, so 13 now runs
# the kernels' checks only: the compile checks' code did not change and call 12 runs them all).
# The nineteenth got no machine (loans paused). Left: 13 again (the kernels' checks, every floor's
# row on the code after it: the norm's backward as one op), then 14 (the norm's op and the weight
# gradients' forms alone, to tune), then 12 (every CUDA check, the Gram's candidates); 15 is 13
# cut to about 7 minutes.
# A session has 30
# device minutes, counted from asking for the machine (a start of a minute or more, again after
# any gap of more than 30 s between calls) until it is given back.
# Every bench writes under $OUT (the only folder that comes back from the device machine) and
# its log is teed there; each runs under its own timeout so a slow one cannot starve the next.
# Calls 3, 4, 5, 9, 10, 13 and 15 install torchao from runs/wheels_gpu (carry it) when it is not importable.
#
#   bash experiments/tools/bench/gpu_queue.sh 1   # issue 35: ODM, ADO, Aioli at 1B (Aioli's validation
#                                                 # cost row); issue 37: the MoE layer against the plain loop
#   bash experiments/tools/bench/gpu_queue.sh 2   # issue 37: stacked 64 vs 8 one by one, fused and unfused head, profiled
#   bash experiments/tools/bench/gpu_queue.sh 3   # issue 36: the 120M FP8 training run (bf16, FP8, FP8 with its head)
#   bash experiments/tools/bench/gpu_queue.sh 4   # issue 35: every method's row at 1B in one run (DoReMi's online
#                                                 # reference in bf16 and FP8, DoGE's k passes and one pass, profiled,
#                                                 # ODM, Aioli, ADO)
#   bash experiments/tools/bench/gpu_queue.sh 5   # issue 36: FP8 steps at 1B with and without the head (FP8.md, G1)
#   bash experiments/tools/bench/gpu_queue.sh 6   # issue 36: the muP transfer sweep on the grid centred on width 256's
#                                                 # optimum (mup_transfer.py's docstring), seeds 0 and 1
#   bash experiments/tools/bench/gpu_queue.sh 7   # issue 36: the same grid with zero head and query init
#   bash experiments/tools/bench/gpu_queue.sh 8   # issue 39: a stacked sweep chunk (4 runs) at the study's proxy
#                                                 # shape against one run (measured slower: the sweep runs one by one)
#   bash experiments/tools/bench/gpu_queue.sh 9   # issue 36: FP8 steps at 1b, MLP linears only (G2) and micro-batch 16 (G3)
#   bash experiments/tools/bench/gpu_queue.sh 10  # issue 36: 1b (micro-batch 16) and d_model 4096 (4) in one run, FP8
#                                                 # rows with the head, ours and torchao on plain
#   bash experiments/tools/bench/gpu_queue.sh 11  # issue 35: DoGE's one-pass kernels alone at 1B's shapes: the Gram's
#                                                 # and the update's launch choices, the weight gradients by row,
#                                                 # batch-major and plain (what a batch-major layout would save)
#   bash experiments/tools/bench/gpu_queue.sh 12  # issue 35: the CUDA checks (tests/test_gpu.py), then the Gram's
#                                                 # candidates and the weight-gradient forms (before call 4)
#   bash experiments/tools/bench/gpu_queue.sh 13  # issue 35: the kernels' CUDA checks, then every floor's row at 1B
#                                                 # within one call (a session whose device time may allow one call)
#   bash experiments/tools/bench/gpu_queue.sh 14  # issue 35: DoGE's norm backward alone (its launch choices against
#                                                 # plain's compiled one) and the weight gradients' forms (grouped_mm)
#   bash experiments/tools/bench/gpu_queue.sh 15  # issue 35: 13 cut to about 7 minutes (the new kernels' checks, every
#                                                 # floor's row, DoGE profiled) for a session with little device time left
#   bash experiments/tools/bench/gpu_queue.sh --print N   # the commands of call N, not run
#
set -u
PY=${PYTHON:-python3}
B=experiments/tools/bench
#: Five learning rates a factor 2 apart with width 256's fitted optimum (0.00153, first GPU sweep) at the centre.
MUP_CENTRED="0.000375 0.00075 0.0015 0.003 0.006"

commands() {
    case "$1" in
    1)
        echo "method_bench 400 $PY $B/method_bench.py --presets 1b --variants plain,odm,ado,aioli --deadline 380 --out \$OUT/method_bench"
        echo "moe_bench 170 $PY $B/moe_bench.py --preset moe-1b-active --micro-batch 4 --seq 2048 --steps 10 --warmup 3 --parts layer,step-compiled --out \$OUT/moe_bench"
        ;;
    2)
        echo "stacked_bench_fused 200 $PY $B/stacked_bench.py --device cuda --compile --models 64 --single 8 --profile 15 --count-ops"
        echo "stacked_bench_unfused 200 $PY $B/stacked_bench.py --device cuda --compile --models 64 --single 8 --unfused-head"
        ;;
    3) echo "fp8_bench 400 $PY $B/fp8_bench.py train --with-head --out \$OUT/fp8" ;;
    5) echo "fp8_bench 560 $PY $B/fp8_bench.py step --sizes 1b --micro-batch 8 --with-head --out \$OUT/fp8_g1" ;;
    4) echo "method_bench 580 $PY $B/method_bench.py --presets 1b --deadline 550 --profile plain,doge --out \$OUT/method_bench" ;;
    6)
        echo "mup_transfer_centred 200 $PY experiments/tools/mup_transfer.py --lrs $MUP_CENTRED --max-seconds 170 --out \$OUT/mup_centred"
        echo "mup_transfer_centred_seed1 200 $PY experiments/tools/mup_transfer.py --lrs $MUP_CENTRED --max-seconds 170 --seed 1 --out \$OUT/mup_centred_seed1"
        ;;
    8) echo "stacked_bench_sweep_shape 300 $PY $B/stacked_bench.py --device cuda --compile --models 4 --single 1 --d-model 384 --layers 6 --heads 6 --ffn 1152 --vocab 2048 --seq 1024 --batch 96 --steps 5 --warmup 2" ;;
    7) echo "mup_transfer_zero 200 $PY experiments/tools/mup_transfer.py --lrs $MUP_CENTRED --max-seconds 170 --zero-init --out \$OUT/mup_zero" ;;
    9)
        echo "fp8_bench_mlp_only 260 $PY $B/fp8_bench.py step --sizes 1b --micro-batch 8 --fp8-layers gate_up down --out \$OUT/fp8_g2"
        echo "fp8_bench_mb16 300 $PY $B/fp8_bench.py step --sizes 1b --micro-batch 16 --out \$OUT/fp8_g3"
        ;;
    10) echo "fp8_bench_one_run 560 $PY $B/fp8_bench.py step --sizes 1b 4096 --micro-batch 16 4 --only-with-head --out \$OUT/fp8_one_run" ;;
    11) echo "doge_kernels_bench 300 $PY $B/doge_kernels_bench.py --preset bench-1b --out \$OUT/doge_kernels" ;;
    12)
        echo "test_gpu 200 $PY tests/test_gpu.py"
        echo "doge_kernels_bench 300 $PY $B/doge_kernels_bench.py --preset bench-1b --parts gram,dw --reps 3 --out \$OUT/doge_kernels"
        ;;
    13)
        echo "test_gpu_kernels 150 $PY tests/test_gpu.py doge_embedding group_norm doge_one_pass device_timer combined gram profile triton_"
        echo "method_bench 410 $PY $B/method_bench.py --presets 1b --variants plain,doremi-fp8,doge,odm,aioli,ado --deadline 370 --profile plain,doge --out \$OUT/method_bench"
        ;;
    15)
        echo "test_gpu_kernels 90 $PY tests/test_gpu.py doge_embedding group_norm doge_one_pass"
        echo "method_bench 330 $PY $B/method_bench.py --presets 1b --variants plain,doremi-fp8,doge,odm,aioli,ado --deadline 300 --profile doge --out \$OUT/method_bench"
        ;;
    14) echo "doge_kernels_bench 300 $PY $B/doge_kernels_bench.py --preset bench-1b --parts norm,dw --reps 3 --out \$OUT/doge_kernels" ;;
    *)
        echo "gpu_queue.sh: expected a call number 1 to 15, got '$1'" >&2
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
if { [ "${1:-}" = 3 ] || [ "${1:-}" = 4 ] || [ "${1:-}" = 5 ] || [ "${1:-}" = 9 ] || [ "${1:-}" = 10 ] || [ "${1:-}" = 13 ] || [ "${1:-}" = 15 ]; } && ! $PY -c "import torchao" 2>/dev/null; then
    $PY -m pip install -q --no-deps runs/wheels_gpu/torchao-*.whl || exit 1
fi
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
