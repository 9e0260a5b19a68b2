#!/usr/bin/env bash
# Sharding benchmark: the same mlp (drivers/mlp.rs, AdamW) trained under
# DDP (MULTI_CPU), ZeRO-1/2/3 (DEEPSPEED) and FSDP FULL_SHARD/SHARD_GRAD_OP,
# measuring step time and each rank's memory (`mlp --print-memory`).
#
# Usage: bash benches/sharding.sh [OUT_DIR]   (default target/bench-results)
#   env: HIDDEN=512 LAYERS=8 BATCH=32 STEPS=30 RANKS=4 REPEATS=3
# Writes OUT_DIR/sharding/*.yaml (one accel config per strategy),
# OUT_DIR/sharding/<strategy>.<run>.txt (each run's stdout),
# OUT_DIR/sharding.jsonl (one object per run: strategy, run, steps_per_s,
# loss_last, wall_s, memory = rank 0's `mlp-memory` line) and OUT_DIR/sharding.md
# (the Markdown table, also printed).
#
# ms/step is 1000 / the median of the runs' steps/s (rank 0's summary line,
# printed to 0.1 steps/s). Memory is deterministic, so it is taken from the
# first run. params/grads MiB are the strategy's accounting (param_bytes,
# grad_bytes), optimizer state the optimizer's real state bytes
# (optimizer_state_bytes), peak the strategy's peak during the last step of
# parameters, gradients and communication buffers (peak_bytes less the
# strategy's optimizer-state estimate optimizer_bytes, which only the
# sharding strategies make: so every row counts the same things).
source "$(dirname "$0")/common.sh" target/bench-results "${1:-}"
hidden=${HIDDEN:-512}
layers=${LAYERS:-8}
batch=${BATCH:-32}
steps=${STEPS:-30}
ranks=${RANKS:-4}
repeats=${REPEATS:-3}
mkdir -p "$out/sharding"
cargo build --release -q -p accel-cli -p accel-ddp -p accel-zero -p accel-fsdp -p accel-drivers
rel=target/release
cfgdir="$out/sharding"

# config NAME DISTRIBUTED_TYPE [LINE...]: writes $cfgdir/NAME.yaml.
config() {
    local name=$1 type=$2
    shift 2
    {
        printf 'distributed_type: %s\nnum_processes: %s\nuse_cpu: true\n' "$type" "$ranks"
        [ $# -eq 0 ] || printf '%s\n' "$@"
    } >"$cfgdir/$name.yaml"
}
wrap=('  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP' '  fsdp_transformer_layer_cls_to_wrap: layers')
strategies=(ddp zero1 zero2 zero3 fsdp_full_shard fsdp_shard_grad_op)
config ddp MULTI_CPU
for s in 1 2 3; do
    config "zero$s" DEEPSPEED 'deepspeed_config:' "  zero_stage: $s"
done
config fsdp_full_shard FSDP 'fsdp_config:' '  fsdp_sharding_strategy: FULL_SHARD' "${wrap[@]}"
config fsdp_shard_grad_op FSDP 'fsdp_config:' '  fsdp_sharding_strategy: SHARD_GRAD_OP' "${wrap[@]}"

args=(--hidden "$hidden" --layers "$layers" --batch-size "$batch" --steps "$steps"
      --optimizer adamw --lr 0.001 --print-memory)
echo "== sharding: hidden $hidden, layers $layers, batch $batch/rank, $steps steps, $ranks ranks, $repeats runs each"
: >"$out/sharding.jsonl"
for s in "${strategies[@]}"; do
    for run in $(seq 1 "$repeats"); do
        txt="$cfgdir/$s.$run.txt"
        t0=$(date +%s.%N)
        $rel/accel launch -q --config_file "$cfgdir/$s.yaml" $rel/mlp "${args[@]}" >"$txt" \
            || { cat "$txt"; echo "sharding.sh: $s run $run failed" >&2; exit 1; }
        t1=$(date +%s.%N)
        python - "$s" "$run" "$txt" "$t0" "$t1" <<'PY' | tee -a "$out/sharding.jsonl"
import json, re, sys
strategy, run, path, t0, t1 = sys.argv[1:]
text = open(path).read()
mem = [json.loads(l.split("mlp-memory", 1)[1]) for l in text.splitlines() if "mlp-memory {" in l]
rank0 = [m for m in mem if m["rank"] == 0]
summary = re.findall(r"mlp: (\d+) steps, loss (\S+) -> (\S+), ([\d.]+) steps/s", text)
used = re.findall(r"strategy (\w+) \(", text)
if len(rank0) != 1 or not summary:
    sys.exit(f"{path}: expected one rank-0 mlp-memory line and the summary line:\n{text}")
# The plugin that ran must be the one the config asked for (ddp, zero, fsdp).
if used != [re.sub(r"\d+$|_.*", "", strategy)]:
    sys.exit(f"{path}: {strategy} ran as strategy {used}:\n{text}")
print(json.dumps({"strategy": strategy, "run": int(run), "steps_per_s": float(summary[-1][3]),
                  "loss_last": float(summary[-1][2]), "wall_s": round(float(t1) - float(t0), 3),
                  "memory": rank0[0]}))
PY
    done
done

python - "$out/sharding.jsonl" "$hidden" "$layers" "$batch" "$steps" "$ranks" <<'PY' | tee "$out/sharding.md"
import json, statistics, sys
path, hidden, layers, batch, steps, ranks = sys.argv[1:]
runs = [json.loads(l) for l in open(path)]
names = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3",
         "fsdp_full_shard": "FSDP FULL_SHARD", "fsdp_shard_grad_op": "FSDP SHARD_GRAD_OP"}
order = list(dict.fromkeys(r["strategy"] for r in runs))
mib = lambda b: b / 2**20
def state(m):
    return m["param_bytes"] + m["grad_bytes"] + m["optimizer_state_bytes"]
ddp = next(r["memory"] for r in runs if r["strategy"] == "ddp")
print(f"mlp, hidden {hidden}, {layers} extra layers, batch {batch}/rank, {steps} steps, "
      f"AdamW, {ranks} CPU ranks; memory of rank 0\n")
print("| strategy | ms/step (median; runs) | params MiB/rank | grads MiB/rank "
      "| optimizer state MiB/rank | peak params+grads+buffers MiB/rank "
      "| params+grads+opt state vs DDP |")
print("|---|---|---|---|---|---|---|")
for s in order:
    rs = [r for r in runs if r["strategy"] == s]
    ms = [1000 / r["steps_per_s"] for r in rs]
    med = 1000 / statistics.median(r["steps_per_s"] for r in rs)
    m = rs[0]["memory"]
    assert all(r["memory"] == m for r in rs), f"{s}: memory differs between runs"
    runs_txt = ", ".join(f"{x:.1f}" for x in ms)
    print(f"| {names.get(s, s)} | {med:.1f} ({runs_txt}) | {mib(m['param_bytes']):.3f} "
          f"| {mib(m['grad_bytes']):.3f} | {mib(m['optimizer_state_bytes']):.3f} "
          f"| {mib(m['peak_bytes'] - m['optimizer_bytes']):.3f} | {state(m) / state(ddp):.2f}x |")
print("\nms/step: 1000 / steps/s of rank 0's summary line. params/grads/peak: the strategy's "
      "accounting (peak: the most parameter, gradient and communication-buffer bytes held at "
      "once during the last step); optimizer state: the optimizer's real state bytes.")
PY
