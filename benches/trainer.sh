#!/usr/bin/env bash
# The Trainer's overhead: `accel train` (accel-train's Trainer) against the
# hand-written loop of the clm example, on the same transformers-made Llama
# (4 layers × 256 hidden, 4 heads / 2 key-value heads, vocab 8192), the same
# tokens (the Trainer's token cache is a u32 token file clm reads), sequence
# 256, batch 4 per rank, 40 AdamW steps with clipping and a linear schedule,
# 2 CPU ranks under DDP; each run twice, alternating, steps/s of the loop
# (clm's `steps/s`, the Trainer's `train_steps_per_second`).
#
# Usage: bash benches/trainer.sh [OUT_DIR]   (needs scripts/bootstrap.sh first)
source "$(dirname "$0")/common.sh" target/bench-results/trainer "${1:-}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
cargo build --release -q -p accel-cli -p accel-ddp -p accel-drivers
rel=$PWD/target/release
llama_4x256 "$out/model"
word_lines "$out/train.txt" 20000
steps=40
batch=4
block=256
train_args=(--model_name_or_path "$out/model" --train_file "$out/train.txt" --block_size $block
            --per_device_train_batch_size $batch --max_steps $steps --learning_rate 3e-4
            --logging_steps 20 --save_strategy no --report_to none --disable_tqdm true)
# Tokenize once (the cache), then find the token file clm reads.
"$rel/accel" train "${train_args[@]}" --max_steps 1 --output_dir "$out/warm" >/dev/null 2>&1
tokens=$(ls "$out"/.train.txt.*.tokens | head -1)
clm_args=(--model "$out/model" --data "$tokens" --token-dtype u32 --block-size $block --batch-size $batch
          --steps $steps --lr 3e-4 --weight-decay 0 --scheduler linear --max-grad-norm 1.0)

: >"$out/results.jsonl"
echo "== Llama 4x256, sequence $block, batch $batch per rank, $steps steps, 2 ranks (DDP)"
for round in 1 2; do
    rm -rf "$out/run"
    "$rel/accel" launch -q --cpu --num_processes 2 "$rel/accel" train "${train_args[@]}" --output_dir "$out/run" >/dev/null 2>&1
    python - "$round" "$out/run/train_results.json" <<'PY' | tee -a "$out/results.jsonl"
import json, sys
r = json.load(open(sys.argv[2]))
print(json.dumps({"run": "accel train (Trainer)", "round": int(sys.argv[1]), "steps_per_s": r["train_steps_per_second"]}))
PY
    sps=$("$rel/accel" launch -q --cpu --num_processes 2 "$rel/clm" "${clm_args[@]}" 2>&1 | grep -oE '[0-9.]+ steps/s' | tail -1 | grep -oE '^[0-9.]+')
    echo "{\"run\": \"clm (hand-written loop)\", \"round\": $round, \"steps_per_s\": $sps}" | tee -a "$out/results.jsonl"
done
python - "$out/results.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
best = lambda name: max(r["steps_per_s"] for r in rows if r["run"].startswith(name))
t, c = best("accel train"), best("clm")
print(f"Trainer {t:.3f} steps/s, hand-written loop {c:.3f} steps/s: the Trainer at {t / c:.3f}x ({(1 - t / c) * 100:+.1f}% overhead)")
PY
echo "results: $out/results.jsonl"
