#!/usr/bin/env bash
# The prepared device runs of a session that is lent one GPU (15 minutes of device time, all starts
# included; at most 10 minutes a call; 8 files back from $OUT). Each call is one command:
#
#   bash bench/gpu_session.sh 1   # <= 8 min: make test-gpu (~4.5 min last time: every kernel compiled,
#                                 # the split-K default and the tree mask included) + bench.gpu.quant_sweep
#                                 # cut to 130 s (#39; M = 1 and 16 first)
#   bash bench/gpu_session.sh 2   # <= 5 min: bench.gpu's engine parts, bf16 / int8 / int4 / fp8 decode
#                                 # at batch 1, 16, 64, 256 (#39's targets, the same run's bf16 baseline)
#   bash bench/gpu_session.sh 3   # ~7 min: bench.gpu.decode (#40: profile, MBU per setting, knee)
#   bash bench/gpu_session.sh 4   # ~5 min: bench.gpu.attention, every part (#41)
#   bash bench/gpu_session.sh 5   # <= 9 min: bench.multiturn on the random 8B shape, the prefix cache's
#                                 # host tier off vs on with pinned host buffers (#55's GPU target: TTFT
#                                 # p50 of returning turns and prefill tokens, both >= 3x); never run yet:
#                                 # the 8B steps' warm-up (7 token buckets, Pallas) is the unknown, so 9 min
#
# One 15-minute session holds calls 1 and 2 (about 13 min of commands; the last session's start, idle
# and transfers took ~3.5 min): run call 1 with timeout_s 470 and call 2 within 30 s of its reply
# (timeout_s 320) to keep the machine warm. Calls 3, 4 and 5 are the next sessions' (timeout_s 570 for 5).
# Results land in $OUT (JSON, logs as one tarball); copy them to bench/results/ and commit them.
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LOGS=/tmp/gpu-session-logs
mkdir -p "$LOGS"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/nvidia-smi.csv" 2>&1
rc=0
case "${1:-}" in
1)
    PYTEST_ADDOPTS="--junitxml=$OUT/junit.xml" timeout -s INT 330 make test-gpu PY=python3 \
        > "$LOGS/test-gpu.log" 2>&1 || rc=$?
    tail -25 "$LOGS/test-gpu.log"
    timeout -s INT 140 python3 -m bench.gpu.quant_sweep --deadline-s 130 --out "$OUT/quant-sweep.json" \
        > "$LOGS/quant-sweep.log" 2>&1 || rc=$?
    tail -40 "$LOGS/quant-sweep.log"
    ;;
2)
    timeout -s INT 300 python3 -m bench.gpu --parts ceilings,bf16,int8,int4,fp8 --deadline-s 290 \
        --out "$OUT/gpu.json" --log-dir "$LOGS/gpu" > "$LOGS/gpu.log" 2>&1 || rc=$?
    tail -30 "$LOGS/gpu.log"
    ;;
3)
    timeout -s INT 440 python3 -m bench.gpu.decode --deadline-s 420 --out "$OUT/decode.json" \
        --log-dir "$LOGS/decode" > "$LOGS/decode.log" 2>&1 || rc=$?
    tail -40 "$LOGS/decode.log"
    t=$(ls "$LOGS"/decode/traces/replay/plugins/profile/*/*.trace.json.gz 2>/dev/null | head -1)
    [ -n "$t" ] && cp "$t" "$OUT/replay.trace.json.gz"
    ;;
4)
    timeout -s INT 320 python3 -m bench.gpu.attention --deadline-s 300 --out "$OUT/attention.json" \
        > "$LOGS/attention.log" 2>&1 || rc=$?
    tail -40 "$LOGS/attention.log"
    ;;
5)
    timeout -s INT 540 python3 -m bench.multiturn --shape llama3-8b --kv-offload-gb 2 --reps 2 \
        --out "$OUT/multiturn-8b.json" > "$LOGS/multiturn.log" 2>&1 || rc=$?
    tail -20 "$LOGS/multiturn.log"
    ;;
*)
    echo "usage: bash bench/gpu_session.sh 1|2|3|4|5" >&2
    exit 2
    ;;
esac
tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null
exit $rc
