#!/usr/bin/env bash
# The main job: set up, build, show the plugin system at work, then train
# the `train-mlp` example (the Trainer) with DDP on 2 CPU processes under `accel launch`
# (bf16, trackers, checkpoints).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh

plugins=target/plugins
runs=target/runs
mkdir -p "$plugins" "$runs"
cp target/debug/libaccel_csv_tracker.so "$plugins/"

echo "== accel plugins list --plugin-dir $plugins"
target/debug/accel plugins list --plugin-dir "$plugins"
echo
echo "== accel config validate configs/*.yaml"
target/debug/accel config validate configs/*.yaml
echo
echo "== accel launch --dry-run (2 CPU ranks, from configs/ddp_cpu_2.yaml)"
target/debug/accel launch --config_file configs/ddp_cpu_2.yaml --launcher local --dry-run target/debug/quickstart | grep -E '^rank|RANK=|WORLD_SIZE=|\$'
echo
echo "== quickstart, logging through the csv plugin and the built-in jsonl tracker"
target/debug/quickstart --plugin-dir "$plugins" --log-with csv --log-with jsonl --project-dir "$runs"
echo
echo "== $runs/quickstart/metrics.csv (last lines)"
tail -n 4 "$runs/quickstart/metrics.csv"

echo
echo "== accel launch --cpu --num_processes 2 train-mlp (the Trainer with transformers' TrainingArguments:"
echo "   DDP over MPI, bf16 autocast, cosine schedule, clipping, TensorBoard, checkpoint-100 and -200)"
rm -rf "$runs/mlp"
target/debug/accel launch --cpu --num_processes 2 target/debug/train-mlp \
  --output_dir "$runs/mlp" --max_steps 200 --learning_rate 1e-2 --bf16 true \
  --lr_scheduler_type cosine --warmup_steps 10 --max_grad_norm 1.0 \
  --logging_steps 50 --eval_strategy steps --eval_steps 100 --save_steps 100 --save_total_limit 2 \
  --report_to tensorboard
echo
echo "outputs: $runs/mlp/ (model.safetensors, trainer_state.json with the log history,"
echo "         checkpoint-100/ and checkpoint-200/, TensorBoard events: tensorboard --logdir $runs/mlp),"
echo "         tracker files $runs/quickstart/"
