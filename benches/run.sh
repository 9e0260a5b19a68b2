#!/usr/bin/env bash
# Runs the benchmarks behind BENCHMARKS.md on this machine (release builds):
#   1. accel's per-step overhead vs a raw tch loop, one process (criterion,
#      and paired alternating blocks, which cancel a shared VM's drift);
#   2. DDP step with vs without gradient sync, and DDP's bucketed all-reduce
#      vs one raw MPI all-reduce (2 ranks);
#   3. mlp under `accel launch` vs the same MLP under Python Accelerate
#      (torchrun, 2 gloo ranks), and a raw single-process tch loop, for
#      hidden 128 / batch 32 and hidden 1024 / batch 256;
#   4. the one-run throughput table (`throughput.sh`): mlp small and big and
#      gpt2 under accel DDP (overlap on/off), FSDP FULL_SHARD and ZeRO-3 vs
#      Python Accelerate DDP and one process, with DDP's exposed
#      all-reduce; quiet, then with one competing process per core
#      (`UPDATE_BENCHMARKS=1` writes both tables into BENCHMARKS.md).
# Usage: bash benches/run.sh [OUT_DIR]   (needs scripts/bootstrap.sh first)
source "$(dirname "$0")/common.sh" target/bench-results "${1:-}"
cargo build --release -q -p accel-cli -p accel-ddp -p accel-drivers -p accel-benches
rel=target/release

echo "== criterion: per-step overhead (one process)"
cargo bench -q -p accel-benches --bench overhead -- --noplot 2>&1 | grep -E "^step_|time:" | tee "$out/overhead.txt"

echo "== per-step overhead, paired blocks (one process)"
$rel/overhead_paired 128 32 40 | tee "$out/overhead_paired.jsonl"
$rel/overhead_paired 1024 256 20 | tee -a "$out/overhead_paired.jsonl"

echo "== DDP (2 ranks)"
for hb in "128 32 2000" "1024 256 100"; do
    $rel/accel launch -q --cpu --num_processes 2 $rel/ddp_bench $hb | tee -a "$out/ddp.jsonl"
done

echo "== mlp vs Python Accelerate (2 ranks) and the raw loop"
for cfg in "128 32 2000 0.01" "1024 256 150 0.001"; do
    read -r h b steps lr <<<"$cfg"
    dir="$out/h$h"
    mkdir -p "$dir"
    python benches/peers/make_inputs.py "$dir" "$h" 16384
    common=(--data "$dir/data.safetensors" --init "$dir/init.safetensors" --hidden "$h"
            --batch-size "$b" --steps "$steps" --lr "$lr")
    $rel/accel launch -q --cpu --num_processes 2 $rel/mlp "${common[@]}" --optimizer sgd \
        --loss-log "$dir/accel.jsonl" | tee "$dir/accel.txt"
    torchrun --nproc_per_node 2 --master_port 29533 benches/peers/accelerate_mlp.py "${common[@]}" \
        --loss-log "$dir/accelerate.jsonl" 2>/dev/null | tee "$dir/accelerate.txt"
    $rel/raw_loop "$h" "$b" "$steps" | tee "$dir/raw.json"
    python - "$dir" <<'PY'
import json, sys
d = sys.argv[1]
a = [json.loads(l)["loss"] for l in open(f"{d}/accel.jsonl")]
p = [json.loads(l)["loss"] for l in open(f"{d}/accelerate.jsonl")]
diff = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, p))
print(json.dumps({"steps": len(a), "loss_max_rel_diff": diff, "first": [a[0], p[0]], "last": [a[-1], p[-1]]}))
PY
done

echo "== throughput, one run: quiet, then with one competing process per core"
bash benches/throughput.sh "$out/throughput"
LOAD=1 REPEATS=${LOAD_REPEATS:-2} BENCH_COLUMNS="ddp peer" WORKLOADS="mlp_small gpt2" \
    bash benches/throughput.sh "$out/throughput-load"
