#!/usr/bin/env bash
# The main job: set up, build, show the plugin system at work, then train
# the `mlp` example with DDP on 2 CPU processes under `accel launch`
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
echo "== accel launch --cpu --num_processes 2 mlp (DDP over MPI, bf16 autocast, cosine schedule,"
echo "   TensorBoard + JSONL trackers, a checkpoint every 100 steps)"
rm -rf "$runs/mlp"
target/debug/accel launch --cpu --num_processes 2 target/debug/mlp \
  --steps 200 --optimizer adamw --lr 0.01 --mixed-precision bf16 \
  --scheduler cosine --warmup 10 --max-grad-norm 1.0 \
  --log-with tensorboard --log-with jsonl --project-dir "$runs/mlp" \
  --checkpoint-every 100 --total-limit 2 \
  --loss-log "$runs/mlp_loss.jsonl" --save "$runs/mlp.safetensors"
echo
echo "outputs: loss log $runs/mlp_loss.jsonl (last: $(tail -n 1 "$runs/mlp_loss.jsonl")),"
echo "         weights $runs/mlp.safetensors, checkpoints $runs/mlp/checkpoints/,"
echo "         TensorBoard events $runs/mlp/mlp/ (tensorboard --logdir $runs/mlp),"
echo "         tracker files $runs/quickstart/"
