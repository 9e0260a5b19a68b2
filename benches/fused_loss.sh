#!/usr/bin/env bash
# Peak memory of the training loss: `accel train` with and without
# `--use_liger_kernel true` (the fused linear cross-entropy) beside
# transformers' Trainer (tests/peers/run_clm_reference.py, its plain
# ForCausalLMLoss: Liger's kernels need Triton, which CPUs lack), on the same
# transformers-made Llama (2 layers x 256 hidden, vocab 32,000, untied head),
# sequence 512, batch 4, one process, 3 AdamW steps; the peak RSS of each
# (GNU time's maximum resident set size), and the logits' bytes of one batch.
#
# Usage: bash benches/fused_loss.sh [OUT_DIR]   (needs scripts/bootstrap.sh first)
source "$(dirname "$0")/common.sh" target/bench-results/fused_loss "${1:-}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
cargo build --release -q -p accel-cli
rel=$PWD/target/release
config='{"model_type": "llama", "vocab_size": 32000, "hidden_size": 256, "intermediate_size": 688,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
  "max_position_embeddings": 512, "tie_word_embeddings": false, "eos_token_id": null, "bos_token_id": null}'
llama_model "$out/model" "$config"
word_lines "$out/train.txt" 3000
args=(--model_name_or_path "$out/model" --train_file "$out/train.txt" --block_size 512
      --per_device_train_batch_size 4 --max_steps 3 --learning_rate 3e-4 --logging_steps 1
      --save_strategy no --report_to none --disable_tqdm true --use_cpu)
peak() { # NAME COMMAND...: runs it, prints {"run", "peak_rss_mb", "loss"}
    local name=$1; shift
    rm -rf "$out/run"
    /usr/bin/time -f '%M' -o "$out/rss" "$@" --output_dir "$out/run" >"$out/log" 2>&1 ||
        { cat "$out/log"; exit 1; }
    python - "$name" "$out/rss" "$out/run/trainer_state.json" <<'PY' | tee -a "$out/results.jsonl"
import json, sys
rss = int(open(sys.argv[2]).read().split()[-1]) / 1024
losses = [e["loss"] for e in json.load(open(sys.argv[3]))["log_history"] if "loss" in e]
print(json.dumps({"run": sys.argv[1], "peak_rss_mb": round(rss, 1), "losses": losses}))
PY
}
: >"$out/results.jsonl"
"$rel/accel" train "${args[@]}" --max_steps 1 --output_dir "$out/warm" >/dev/null 2>&1  # the token cache
echo "== Llama 2x256, vocab 32000, sequence 512, batch 4, one process ($OMP_NUM_THREADS threads)"
peak "accel train" "$rel/accel" train "${args[@]}"
peak "accel train --use_liger_kernel true" "$rel/accel" train "${args[@]}" --use_liger_kernel true
peak "transformers Trainer" python tests/peers/run_clm_reference.py "${args[@]}"
python - "$out/results.jsonl" <<'PY'
import json, sys
rows = {r["run"]: r for r in map(json.loads, open(sys.argv[1]))}
fused, plain, hf = (rows[k]["peak_rss_mb"] for k in ("accel train --use_liger_kernel true", "accel train", "transformers Trainer"))
logits = 4 * 512 * 32000 * 4 / 2**20
print(f"peak RSS: fused {fused:.0f} MB, unfused {plain:.0f} MB, transformers {hf:.0f} MB: "
      f"fused at {fused / hf:.2f}x transformers', {fused / plain:.2f}x unfused; one batch's float32 logits: {logits:.0f} MB")
PY
echo "results: $out/results.jsonl"
