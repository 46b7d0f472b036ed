#!/usr/bin/env bash
# The prepared device runs of a session that is lent one GPU (15 minutes of device time, all starts
# included; at most 10 minutes a call; 8 files back from $OUT). Each call is one command:
#
#   bash bench/gpu_session.sh 1   # <= 7.5 min: make test-gpu in 3 processes (one took 330 s for 129 of
#                                 # the 159 tests on 2026-12-04 and was cut) + bench.gpu.quant_sweep
#                                 # (M = 4 and 8 first: 1 and 16 were timed on 2026-12-04)
#   bash bench/gpu_session.sh 2   # <= 5 min: bench.gpu's engine parts, bf16 / int8 / int4 decode at
#                                 # batch 1, 16, 64, 256 (#58's targets against the same run's bf16;
#                                 # the check of the launch configs shipped from the 2026-12-04 sweep and
#                                 # of the scheduler's fix at 256 requests)
#   bash bench/gpu_session.sh 3   # ~8 min: bench.gpu.decode (#40: profile, MBU per setting, knee; the
#                                 # int8 engine's profile beside bf16's: where int8's extra ~0.5 ms a token goes)
#   bash bench/gpu_session.sh 4   # ~5 min: bench.gpu.attention, every part (#41)
#   bash bench/gpu_session.sh 5   # <= 9 min: bench.multiturn on the random 8B shape, the prefix cache's
#                                 # host tier off vs on with pinned host buffers (#55's GPU target: TTFT
#                                 # p50 of returning turns and prefill tokens, both >= 3x); never run yet:
#                                 # the 8B steps' warm-up (7 token buckets, Pallas) is the unknown, so 9 min
#                                 # (the JSON is rewritten after each rep: a run cut short keeps its reps)
#   bash bench/gpu_session.sh 6   # <= 6.5 min: bench.gpu's fp8 part (cut on 2026-12-04), HF transformers'
#                                 # baseline and the kernels part (matmuls, prefill attention vs cuDNN), then
#                                 # the int4 part with --autotune (its cold start: never measured yet)
#   bash bench/gpu_session.sh 7   # <= 5 min: bench.gpu.quant_sweep on the pre-quantized checkpoints'
#                                 # packed forms (never measured): GGUF's Q4_K as loaded (int4 g32 with
#                                 # float32 zero points, through the int4 kernels since 2026-12-06), Q8_0
#                                 # (grouped int8 g32) and fine-grained FP8 (e4m3 codes g128), both through
#                                 # the grouped 8-bit kernels since 2026-12-06 (XLA their untuned default),
#                                 # against bf16 on the 8B projections; --tuned prints rows to ship
#
# One 15-minute session holds calls 1 and 2 (2026-12-04: the start took ~30 s, then 455 s and 277 s
# of commands, 772 s held in all): run call 1 with timeout_s 470 and call 2 within 30 s of its reply
# (timeout_s 330) to keep the machine warm. Calls 3-6 are the next sessions' (timeout_s 500 for 3, 570
# for 5, 420 for 6; 3 and 4 together: ~810 s of commands, so call 4 within 30 s of call 3's reply).
# Call 7 fits beside 3 or 4 in one session (timeout_s 320).
#   bash bench/gpu_session.sh 8   # <= 5 min: bench.deltanet, the Gated DeltaNet's recurrence (Qwen3.5,
#                                 # Qwen3-Next), then Mamba-2's (--rule mamba2: Granite 4.0-H): the chunks'
#                                 # closed form, which only a GPU runs, against the token-by-token loop
#                                 # (CPU: 0.64x for a 512-token prompt, Mamba-2's 0.56x; the prediction on
#                                 # a GPU: several times faster, each token of the loop being a few kernel
#                                 # launches); fits beside call 7 or alone (timeout_s 320)
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
    PYTEST_ADDOPTS="--junitxml=$OUT/junit.xml" timeout -s INT 280 make test-gpu PY=python3 \
        > "$LOGS/test-gpu.log" 2>&1 || rc=$?
    tail -25 "$LOGS/test-gpu.log"
    timeout -s INT 170 python3 -m bench.gpu.quant_sweep --deadline-s 160 --out "$OUT/quant-sweep.json" \
        > "$LOGS/quant-sweep.log" 2>&1 || rc=$?
    tail -40 "$LOGS/quant-sweep.log"
    ;;
2)
    timeout -s INT 310 python3 -m bench.gpu --parts ceilings,bf16,int8,int4 --deadline-s 300 \
        --out "$OUT/gpu.json" --log-dir "$LOGS/gpu" > "$LOGS/gpu.log" 2>&1 || rc=$?
    tail -30 "$LOGS/gpu.log"
    ;;
3)
    timeout -s INT 485 python3 -m bench.gpu.decode --deadline-s 465 --out "$OUT/decode.json" \
        --log-dir "$LOGS/decode" > "$LOGS/decode.log" 2>&1 || rc=$?
    tail -40 "$LOGS/decode.log"
    t=$(ls "$LOGS"/decode/traces/replay/plugins/profile/*/*.trace.json.gz 2>/dev/null | head -1)
    [ -n "$t" ] && cp "$t" "$OUT/replay.trace.json.gz"
    ;;
4)
    timeout -s INT 320 python3 -m bench.gpu.attention --deadline-s 300 --out "$OUT/attention.json" \
        --log-dir "$LOGS/attention" > "$LOGS/attention.log" 2>&1 || rc=$?
    tail -40 "$LOGS/attention.log"
    ;;
5)
    timeout -s INT 540 python3 -m bench.multiturn --shape llama3-8b --kv-offload-gb 2 --reps 2 \
        --out "$OUT/multiturn-8b.json" > "$LOGS/multiturn.log" 2>&1 || rc=$?
    tail -20 "$LOGS/multiturn.log"
    ;;
6)
    timeout -s INT 290 python3 -m bench.gpu --parts ceilings,fp8,hf,kernels --deadline-s 280 \
        --out "$OUT/gpu-fp8-hf-kernels.json" --log-dir "$LOGS/gpu" > "$LOGS/gpu.log" 2>&1 || rc=$?
    tail -30 "$LOGS/gpu.log"
    # #58's cold start of the first int4 request with autotuning on (<= 30 s: the part's build_s +
    # batch1.first_request_s); only its first numbers are needed, so the part may be cut at 90 s
    timeout -s INT 100 python3 -m bench.gpu --parts int4 --autotune --deadline-s 90 \
        --out "$OUT/gpu-int4-autotune.json" --log-dir "$LOGS/gpu-int4-autotune" \
        > "$LOGS/gpu-int4-autotune.log" 2>&1 || rc=$?
    tail -12 "$LOGS/gpu-int4-autotune.log"
    ;;
7)
    timeout -s INT 300 python3 -m bench.gpu.quant_sweep --formats bf16,q4k,q8_0,fp8b --deadline-s 290 \
        --out "$OUT/quant-sweep-gguf.json" --log-dir "$LOGS/quant-sweep-gguf" \
        > "$LOGS/quant-sweep-gguf.log" 2>&1 || rc=$?
    tail -40 "$LOGS/quant-sweep-gguf.log"
    ;;
8)
    timeout -s INT 150 python3 -m bench.deltanet --reps 9 --out "$OUT/deltanet.json" \
        > "$LOGS/deltanet.log" 2>&1 || rc=$?
    tail -12 "$LOGS/deltanet.log"
    timeout -s INT 150 python3 -m bench.deltanet --rule mamba2 --reps 9 --out "$OUT/mamba2.json" \
        > "$LOGS/mamba2.log" 2>&1 || rc=$?
    tail -12 "$LOGS/mamba2.log"
    ;;
*)
    echo "usage: bash bench/gpu_session.sh 1|2|3|4|5|6|7|8" >&2
    exit 2
    ;;
esac
tar czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null
exit $rc
