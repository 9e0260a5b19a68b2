#!/usr/bin/env bash
# Llama training and generation: accel (the clm example, `accel generate`)
# beside transformers + Accelerate in the same run, on the same
# transformers-made model.
#
# * Training: a Llama of 4 layers × 256 hidden (4 heads / 2 key-value heads,
#   intermediate 688, vocab 8192), sequence 256, batch 4 per rank, 20 AdamW
#   steps on 2 CPU ranks under DDP and FSDP (LlamaDecoderLayer units):
#   tokens/s and the peak RSS per rank, for accel and for
#   tests/peers/clm_reference.py under torchrun (gloo; --fsdp: FSDP2 on
#   the decoder layers); and accel DDP with activation checkpointing of
#   every decoder layer (its peak RSS against DDP's).
# * Generation: 64 new tokens, greedy, batch 1 and 8, with the key/value
#   cache and without, `accel generate` against transformers' `generate`
#   (tests/peers/models_reference.py), tokens/s of the generate call.
#
# Usage: bash benches/llama.sh [OUT_DIR]   (needs scripts/bootstrap.sh first)
source "$(dirname "$0")/common.sh" target/bench-results/llama "${1:-}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
cargo build --release -q -p accel-cli -p accel-ddp -p accel-fsdp -p accel-drivers
rel=$PWD/target/release
train_peer=tests/peers/clm_reference.py
models_peer=tests/peers/models_reference.py

llama_4x256 "$out/model"
[ -f "$out/tokens.bin" ] || python - "$out/tokens.bin" <<'PY'
import sys, numpy as np
np.random.default_rng(0).integers(0, 8192, 1_000_000, dtype=np.uint16).tofile(sys.argv[1])
PY
cat > "$out/ddp.yaml" <<'YAML'
distributed_type: MULTI_CPU
num_processes: 2
use_cpu: true
YAML
cat > "$out/fsdp.yaml" <<'YAML'
distributed_type: FSDP
num_processes: 2
use_cpu: true
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
YAML

steps=20
batch=4
block=256
common=(--model "$out/model" --data "$out/tokens.bin" --block-size $block --batch-size $batch
        --steps $steps --lr 3e-4 --weight-decay 0.01 --data-seed 1)

train_row() {  # name match command...
    local name=$1 match=$2; shift 2
    local log kb; log=$(mktemp)
    kb=$(peak_rss "$log" "$match" "$@")
    local sps; sps=$(grep -oE '[0-9.]+ steps/s' "$log" | tail -1 | grep -oE '^[0-9.]+')
    python - "$name" "$kb" "$sps" $batch $block <<'PY' | tee -a "$out/results.jsonl"
import json, sys
name, kb, sps, batch, block = sys.argv[1:]
sps = float(sps)
print(json.dumps({"run": name, "ranks": 2, "steps_per_s": sps,
                  "tokens_per_s": round(sps * int(batch) * int(block) * 2),
                  "peak_rss_mib_per_rank": round(int(kb) / 1024)}))
PY
    rm -f "$log"
}

: >"$out/results.jsonl"
echo "== Llama 4x256 (GQA 4/2), vocab 8192, sequence $block, batch $batch per rank, $steps AdamW steps, 2 ranks"
train_row "accel DDP" "$rel/clm" "$rel/accel" launch -q --config_file "$out/ddp.yaml" "$rel/clm" "${common[@]}"
train_row "accel FSDP (LlamaDecoderLayer)" "$rel/clm" "$rel/accel" launch -q --config_file "$out/fsdp.yaml" "$rel/clm" "${common[@]}"
train_row "accel DDP, --gradient-checkpointing" "$rel/clm" "$rel/accel" launch -q --config_file "$out/ddp.yaml" "$rel/clm" "${common[@]}" --gradient-checkpointing
train_row "transformers + Accelerate DDP (torchrun, gloo)" "$train_peer" \
    torchrun --nproc_per_node 2 --master_port 29543 "$train_peer" train "${common[@]}"
train_row "transformers + Accelerate, FSDP2 (torchrun, gloo)" "$train_peer" \
    torchrun --nproc_per_node 2 --master_port 29544 "$train_peer" train "${common[@]}" --fsdp

prompt="the cat sat on the mat and a dog ran to the park while accel trains models"
echo "== generation: 64 new tokens, greedy, one process"
for n in 1 8; do
    prompts=()
    for _ in $(seq "$n"); do prompts+=(--prompt "$prompt"); done
    for cache in "" "--no_cache"; do
        what="batch $n, ${cache:+no }KV cache"
        line=$("$rel/accel" generate --model "$out/model" "${prompts[@]}" --max_new_tokens 64 --ids $cache 2>&1 >/dev/null | grep 'accel generate:')
        python - "accel generate, $what" "$line" <<'PY' | tee -a "$out/results.jsonl"
import json, re, sys
m = re.search(r"(\d+) new tokens in ([0-9.]+) s", sys.argv[2])
print(json.dumps({"run": sys.argv[1], "new_tokens": int(m[1]), "tokens_per_s": round(int(m[1]) / float(m[2]), 1)}))
PY
        theirs=$(python "$models_peer" generate "$out/model" "${prompts[@]}" --max-new-tokens 64 ${cache:+--no-cache} | tail -1)
        python - "transformers generate, $what" "$theirs" <<'PY' | tee -a "$out/results.jsonl"
import json, sys
r = json.loads(sys.argv[2])
n = sum(len(row) for row in r["new"])
print(json.dumps({"run": sys.argv[1], "new_tokens": n, "tokens_per_s": round(n / r["seconds"], 1)}))
PY
    done
done
echo "results: $out/results.jsonl"
