#!/usr/bin/env bash
# Activation checkpointing on gpt2: peak memory saved against step time lost.
# The model and data of benches/gpt2.sh (GPT-2 6 layers, n_embd 384, 6 heads,
# vocab 8192, block 128, batch 8 per rank, AdamW, 30 steps), each run with
# and without checkpointing every block: one process (`--gradient-checkpointing`)
# and FSDP FULL_SHARD on 2 CPU ranks (`fsdp_activation_checkpointing: true`).
# Peak RSS is the largest resident set of any process of the run
# (getrusage(RUSAGE_CHILDREN).ru_maxrss: the largest rank under accel launch).
#
# Usage: bash benches/checkpointing.sh [OUT_DIR]   (needs scripts/bootstrap.sh first)
source "$(dirname "$0")/common.sh" target/bench-results/checkpointing "${1:-}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
cargo build --release -q -p accel-cli -p accel-fsdp -p accel-drivers
rel=$PWD/target/release

[ -d "$out/model" ] || python tests/peers/clm_reference.py init "$out/model" --n-layer 6 \
    --n-embd 384 --n-head 6 --vocab-size 8192 --n-positions 256 --seed 0
[ -f "$out/tokens.bin" ] || python - "$out/tokens.bin" <<'PY'
import sys, numpy as np
np.random.default_rng(0).integers(0, 8192, 2_000_000, dtype=np.uint16).tofile(sys.argv[1])
PY
fsdp="distributed_type: FSDP
num_processes: 2
use_cpu: true
fsdp_config:
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: GPT2Block"
printf '%s\n' "$fsdp" >"$out/fsdp.yaml"
printf '%s\n  fsdp_activation_checkpointing: true\n' "$fsdp" >"$out/fsdp_ac.yaml"

common=(--model "$out/model" --data "$out/tokens.bin" --block-size 128 --batch-size 8
        --steps 30 --lr 3e-4 --weight-decay 0.01 --data-seed 1)

# run NAME COMMAND...: one JSON line with steps/s, peak RSS and the last loss.
run() {
    python - "$@" <<'PY' | tee -a "$out/results.jsonl"
import json, re, resource, subprocess, sys
p = subprocess.run(sys.argv[2:], capture_output=True, text=True)
if p.returncode != 0:
    sys.exit(f"{sys.argv[1]} failed:\n{p.stdout}\n{p.stderr}")
kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
m = re.findall(r"loss [0-9.]+ -> ([0-9.]+), ([0-9.]+) steps/s", p.stdout)[-1]
print(json.dumps({"run": sys.argv[1], "steps_per_s": float(m[1]),
                  "peak_rss_mib": round(kib / 1024), "final_loss": float(m[0])}))
PY
}

: >"$out/results.jsonl"
echo "== gpt2 6x384, block 128, batch 8 per rank, 30 AdamW steps"
run "single" "$rel/clm" "${common[@]}"
run "single, --gradient-checkpointing" "$rel/clm" "${common[@]}" --gradient-checkpointing
run "FSDP FULL_SHARD, 2 ranks" "$rel/accel" launch -q --config_file "$out/fsdp.yaml" "$rel/clm" "${common[@]}"
run "FSDP FULL_SHARD + fsdp_activation_checkpointing, 2 ranks" "$rel/accel" launch -q \
    --config_file "$out/fsdp_ac.yaml" "$rel/clm" "${common[@]}"
