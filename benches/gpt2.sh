#!/usr/bin/env bash
# gpt2 throughput and memory: accel's clm example (drivers/clm.rs) training GPT-2 under
# one process, DDP, FSDP FULL_SHARD (GPT2Block units) and ZeRO-3 on 2 CPU
# ranks, beside transformers' GPT2LMHeadModel under Python Accelerate
# (tests/peers/clm_reference.py: one process, and torchrun with 2 gloo
# ranks = DDP) on the same model, data, order and optimizer.
#
# Model: GPT-2 with 6 layers, n_embd 384, 6 heads, vocab 8192, block 128;
# batch 8 windows per rank, AdamW, 30 steps. Tokens/s counts every rank's
# tokens; peak RSS per rank is the largest VmHWM (from /proc, polled every
# 0.2 s, the same for both sides) among the processes of the run. Then
# attention at block 1024 (batch 2, one process): sdpa and eager, both sides.
#
# Usage: bash benches/gpt2.sh [OUT_DIR]   (needs scripts/bootstrap.sh first)
source "$(dirname "$0")/common.sh" target/bench-results/gpt2 "${1:-}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
cargo build --release -q -p accel-cli -p accel-ddp -p accel-fsdp -p accel-zero -p accel-drivers
rel=$PWD/target/release
peer=tests/peers/clm_reference.py

[ -d "$out/model" ] || python "$peer" init "$out/model" --n-layer 6 --n-embd 384 --n-head 6 \
    --vocab-size 8192 --n-positions 256 --seed 0
[ -f "$out/tokens.bin" ] || python - "$out/tokens.bin" <<'PY'
import sys, numpy as np
np.random.default_rng(0).integers(0, 8192, 2_000_000, dtype=np.uint16).tofile(sys.argv[1])
PY
cat > "$out/fsdp.yaml" <<'YAML'
distributed_type: FSDP
num_processes: 2
use_cpu: true
fsdp_config:
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: GPT2Block
YAML
cat > "$out/zero3.yaml" <<'YAML'
distributed_type: DEEPSPEED
num_processes: 2
use_cpu: true
deepspeed_config:
  zero_stage: 3
YAML

steps=30
batch=8
block=128
common=(--model "$out/model" --data "$out/tokens.bin" --block-size $block --batch-size $batch
        --steps $steps --lr 3e-4 --weight-decay 0.01 --data-seed 1)

# Runs "$@" while polling the peak RSS (VmHWM, kB) of processes whose
# command line contains $match; prints "<max kB> <output>".
measure() {
    local match=$1; shift
    local log peak; log=$(mktemp)
    peak=$(peak_rss "$log" "$match" "$@") || return 1
    echo "$peak $(grep -E 'steps/s' "$log" | tail -1)"
    rm -f "$log"
}

row() {  # name ranks "<peak kB> <summary line>"
    local name=$1 ranks=$2; shift 2
    local kb=${1%% *} line=${1#* }
    local sps; sps=$(echo "$line" | grep -oE '[0-9.]+ steps/s' | grep -oE '^[0-9.]+')
    python - "$name" "$ranks" "$kb" "$sps" $batch $block <<'PY' | tee -a "$out/results.jsonl"
import json, sys
name, ranks, kb, sps, batch, block = sys.argv[1:]
sps = float(sps)
print(json.dumps({"run": name, "ranks": int(ranks), "steps_per_s": sps,
                  "tokens_per_s": round(sps * int(batch) * int(block) * int(ranks)),
                  "peak_rss_mib_per_rank": round(int(kb) / 1024)}))
PY
}

: >"$out/results.jsonl"
echo "== gpt2 6x384, block $block, batch $batch per rank, $steps AdamW steps"
row "accel single" 1 "$(measure "$rel/clm" "$rel/clm" "${common[@]}")"
row "accel DDP" 2 "$(measure "$rel/clm" "$rel/accel" launch -q --cpu --num_processes 2 "$rel/clm" "${common[@]}")"
row "accel FSDP FULL_SHARD" 2 "$(measure "$rel/clm" "$rel/accel" launch -q --config_file "$out/fsdp.yaml" "$rel/clm" "${common[@]}")"
row "accel ZeRO-3" 2 "$(measure "$rel/clm" "$rel/accel" launch -q --config_file "$out/zero3.yaml" "$rel/clm" "${common[@]}")"
row "transformers + Accelerate, 1 process" 1 "$(measure "$peer" python "$peer" train "${common[@]}")"
row "transformers + Accelerate DDP (torchrun, gloo)" 2 "$(measure "$peer" torchrun --nproc_per_node 2 --master_port 29541 "$peer" train "${common[@]}")"

# Attention at GPT-2's own context length: sdpa (transformers' default
# attn_implementation, and accel's) against eager, on both sides, one
# process, block 1024, batch 2 windows, 5 AdamW steps.
[ -d "$out/model1024" ] || python "$peer" init "$out/model1024" --n-layer 6 --n-embd 384 \
    --n-head 6 --vocab-size 8192 --n-positions 1024 --seed 0
block=1024
batch=2
long=(--model "$out/model1024" --data "$out/tokens.bin" --block-size $block --batch-size $batch
      --steps 5 --lr 3e-4 --weight-decay 0.01 --data-seed 1)
echo "== attention: gpt2 6x384, block $block, batch $batch, 5 AdamW steps, one process"
for attn in sdpa eager; do
    row "accel single, $attn attention, block $block" 1 \
        "$(measure "$rel/clm" "$rel/clm" "${long[@]}" --attn-implementation $attn)"
    row "transformers + Accelerate, 1 process, $attn attention, block $block" 1 \
        "$(measure "$peer" python "$peer" train "${long[@]}" --attn-implementation $attn)"
done
