#!/usr/bin/env bash
# DDP's overlap of the gradient all-reduces with backward
# (`accel.plugins.accel-ddp.overlap_comm`) on vs off, 2 CPU ranks (MPI):
# steps/s of mlp (hidden 1024, batch 256: run.sh's large model) and of gpt2
# 6x384 (gpt2.sh's model, block 128, batch 8, AdamW), each setting run
# REPEATS times (default 2), on and off alternating so a shared machine's
# drift hits both; and the exposed communication time: the mean time per
# synced step that post_backward spends communicating (waiting for buckets
# still in flight, or, off, all-reducing all of them), which the plugin
# logs at debug level.
# Usage: bash benches/overlap.sh [OUT_DIR]   (needs scripts/bootstrap.sh first)
source "$(dirname "$0")/common.sh" target/bench-results/overlap "${1:-}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
repeats=${REPEATS:-2}
cargo build --release -q -p accel-cli -p accel-ddp -p accel-drivers
rel=$PWD/target/release

mkdir -p "$out/mlp"
python benches/peers/make_inputs.py "$out/mlp" 1024 16384
peer=tests/peers/clm_reference.py
[ -d "$out/model" ] || python "$peer" init "$out/model" --n-layer 6 --n-embd 384 --n-head 6 \
    --vocab-size 8192 --n-positions 256 --seed 0
[ -f "$out/tokens.bin" ] || python - "$out/tokens.bin" <<'PY'
import sys, numpy as np
np.random.default_rng(0).integers(0, 8192, 2_000_000, dtype=np.uint16).tofile(sys.argv[1])
PY
for overlap in true false; do
    printf 'distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\naccel:\n  plugins:\n    accel-ddp:\n      overlap_comm: %s\n' \
        "$overlap" >"$out/overlap_$overlap.yaml"
done

mlp=(--data "$out/mlp/data.safetensors" --init "$out/mlp/init.safetensors" --hidden 1024
     --batch-size 256 --steps 150 --lr 0.001)
gpt2=(--model "$out/model" --data "$out/tokens.bin" --block-size 128 --batch-size 8
      --steps 30 --lr 3e-4 --weight-decay 0.01 --data-seed 1)

# run NAME PROGRAM ARGS...: both settings, REPEATS times; one JSON line each.
run() {
    local name=$1 program=$2; shift 2
    for i in $(seq "$repeats"); do
        for overlap in true false; do
            local log="$out/$name.$overlap.$i.log"
            ACCEL_LOG=plugin=debug "$rel/accel" launch -q --config_file "$out/overlap_$overlap.yaml" \
                "$rel/$program" "$@" >"$log" 2>&1
            python - "$name" "$overlap" "$log" <<'PY' | tee -a "$out/results.jsonl"
import json, re, sys
name, overlap, log = sys.argv[1:]
text = open(log).read()
sps = float(re.findall(r"([0-9.]+) steps/s", text)[-1])
# Each rank's debug line of totals (logged as its model is dropped).
totals = re.findall(r"(\d+) bucket\(s\) a sync; post_backward communicated mean ([0-9.]+) ms "
                    r"over (\d+) syncs, (\d+) bucket\(s\) started early", text)
buckets, _, syncs, early = totals[0]
print(json.dumps({"run": name, "overlap": overlap == "true", "steps_per_s": sps,
                  "exposed_ms_per_step": [round(float(m), 3) for _, m, _, _ in totals],
                  "buckets_started_in_backward": f"{int(early) / int(syncs):g} of {buckets}"}))
PY
        done
    done
}

: >"$out/results.jsonl"
echo "== mlp hidden 1024, batch 256, 150 SGD steps, 2 ranks"
run mlp mlp "${mlp[@]}"
echo "== gpt2 6x384, block 128, batch 8 per rank, 30 AdamW steps, 2 ranks"
run gpt2 gpt2 "${gpt2[@]}"
