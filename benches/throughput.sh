#!/usr/bin/env bash
# Throughput side by side, in one run, on 2 CPU ranks: the mlp example small
# (hidden 128, batch 32 per rank) and big (hidden 1024, batch 256 per rank)
# and the gpt2 example (6 layers, n_embd 384, 6 heads, block 128, batch 8
# per rank, AdamW), each under accel DDP (gradient all-reduces overlapped
# with backward, and not), FSDP FULL_SHARD and ZeRO-3 (prefetch and
# reduce-scatter overlap on: the defaults, plus `fsdp_forward_prefetch` and
# `fsdp_backward_prefetch: BACKWARD_PRE` as `accelerate config` writes
# them), beside Python Accelerate DDP (torchrun, 2 gloo ranks) on the same
# model, data and optimizer, PyTorch's FSDP2 on the same units (`--fsdp` of
# the peers: Accelerate itself falls back to DDP on a CPU-only machine), and
# one process alone on the same global batch
# (the same program without `accel launch`: every core, no communication;
# the ceiling). With LOAD=1 the same runs happen with one competing
# CPU-bound process per core.
#
# Every cell is the median steps/s of REPEATS runs; the runs of one workload
# alternate columns (accel, peer, ..., accel, peer, ...) so that a drift of
# the machine hits every column alike. The exposed fraction is DDP's
# communication time left after backward with overlap over the same time
# without overlap (all of the all-reduce): on the big mlp and gpt2, per
# synced step the wait of the rank that reached post_backward last (the
# plugin's trace line a rank and sync; an earlier rank's wait also holds
# its wait for that one), averaged from the second sync on; on the small
# mlp, whose steps a line each would slow, the first rank's mean (the line
# of totals the plugin logs at debug level as the model is dropped). Only
# the DDP columns log beyond info: the sharded engine's debug line per
# backward costs 5-10 % on the small mlp.
#
# Usage: bash benches/throughput.sh [OUT_DIR]   (needs scripts/bootstrap.sh)
#   env: REPEATS=3 LOAD=0|1 GPT2_STEPS=20 MLP_SMALL_STEPS=1500 MLP_BIG_STEPS=100
#        WORKLOADS="mlp_small mlp_big gpt2" UPDATE_BENCHMARKS=0|1
#        BENCH_COLUMNS="ddp ddp_no_overlap fsdp zero3 peer peer_fsdp single" (also: zero1,
#        zero1_no_overlap: ZeRO-1 with DeepSpeed's default bucket, overlap on/off;
#        fsdp_bf16 / zero3_bf16: FSDP FULL_SHARD / ZeRO-3 with `mixed_precision:
#        bf16`, parameters gathered and gradients reduce-scattered in bf16;
#        zero1_modules: a bucket per module, each all-reduced during backward;
#        zero3_bucket: ZeRO-3 with reduce_bucket_size 5e8, the modules'
#        gradients reduce-scattered together; zero3_reuse: ZeRO-3 with
#        DeepSpeed's stage3_max_reuse_distance 1e9, modules kept gathered
#        from forward to backward; pair: two one-thread processes at once,
#        each on a rank's batch, no communication: for the small mlp the
#        real ceiling, which "single"'s two intra-op threads are not;
#        ddp_fp16 / peer_fp16: accel DDP with `comm_hook: fp16` / Python
#        Accelerate with DistributedDataParallelKwargs(comm_hook=FP16);
#        ddp_powersgd / peer_powersgd: the same with PowerSGD, rank 1,
#        compressing from the second step, the model in one bucket (with
#        several, PyTorch's chained PowerSGD futures issue gloo collectives
#        in a different order on each rank: "collective mismatch"))
# Writes OUT_DIR/throughput.jsonl (one object per run), OUT_DIR/throughput.md
# (the table, also printed) and, with UPDATE_BENCHMARKS=1, the block between
# the throughput markers of BENCHMARKS.md (`throughput` or `throughput-load`).
source "$(dirname "$0")/common.sh" target/bench-results/throughput "${1:-}"
repeats=${REPEATS:-3}
load=${LOAD:-0}
workloads=${WORKLOADS:-mlp_small mlp_big gpt2}
cargo build --release -q -p accel-cli -p accel-ddp -p accel-fsdp -p accel-zero -p accel-drivers
rel=$PWD/target/release
mlp_peer=benches/peers/accelerate_mlp.py
gpt2_peer=tests/peers/clm_reference.py

# --- inputs -------------------------------------------------------------------
for h in 128 1024; do
    [ -f "$out/h$h/data.safetensors" ] || { mkdir -p "$out/h$h"; python benches/peers/make_inputs.py "$out/h$h" "$h" 16384; }
done
[ -d "$out/gpt2" ] || python "$gpt2_peer" init "$out/gpt2" --n-layer 6 --n-embd 384 --n-head 6 \
    --vocab-size 8192 --n-positions 256 --seed 0
[ -f "$out/tokens.bin" ] || python - "$out/tokens.bin" <<'PY'
import sys, numpy as np
np.random.default_rng(0).integers(0, 8192, 2_000_000, dtype=np.uint16).tofile(sys.argv[1])
PY

# --- configs: one per accel column --------------------------------------------
config() {  # NAME BODY
    printf 'num_processes: 2\nuse_cpu: true\n%s\n' "$2" >"$out/$1.yaml"
}
config ddp "distributed_type: MULTI_CPU
accel:
  plugins:
    accel-ddp: {overlap_comm: true}"
config ddp_fp16 "distributed_type: MULTI_CPU
accel:
  plugins:
    accel-ddp: {comm_hook: fp16}"
config ddp_powersgd "distributed_type: MULTI_CPU
accel:
  plugins:
    accel-ddp: {comm_hook: power_sgd, comm_state_option: {start_powerSGD_iter: 2}, bucket_cap_mb: 1000}"
config ddp_no_overlap "distributed_type: MULTI_CPU
accel:
  plugins:
    accel-ddp: {overlap_comm: false}"
config fsdp "distributed_type: FSDP
fsdp_config:
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_forward_prefetch: true
  fsdp_backward_prefetch: BACKWARD_PRE"
config zero3 "distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: 3"
config fsdp_bf16 "distributed_type: FSDP
mixed_precision: bf16
fsdp_config:
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_forward_prefetch: true
  fsdp_backward_prefetch: BACKWARD_PRE"
config zero3_bf16 "distributed_type: DEEPSPEED
mixed_precision: bf16
deepspeed_config:
  zero_stage: 3"
config zero1 "distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: 1"
ds_file_config() {  # NAME ZERO_OPTIMIZATION_JSON: a DEEPSPEED config with that file
    echo "{\"zero_optimization\": $2}" >"$out/$1.json"
    config "$1" "distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: $out/$1.json"
}
ds_file_config zero1_modules '{"stage": 1, "reduce_bucket_size": 1}'
ds_file_config zero3_bucket '{"stage": 3, "reduce_bucket_size": 5e8}'
ds_file_config zero3_reuse '{"stage": 3, "stage3_max_reuse_distance": 1e9}'
config zero1_no_overlap "distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: 1
accel:
  plugins:
    accel-zero: {overlap_comm: false}"
read -r -a columns <<<"${BENCH_COLUMNS:-ddp ddp_no_overlap fsdp zero3 peer peer_fsdp single}"

# --- workloads ------------------------------------------------------------------
# args WORKLOAD BATCH: the program's arguments (accel and peer take the same).
args() {
    case $1 in
        mlp_small) echo --data "$out/h128/data.safetensors" --init "$out/h128/init.safetensors" \
            --hidden 128 --batch-size "$2" --steps "${MLP_SMALL_STEPS:-1500}" --lr 0.01 ;;
        mlp_big) echo --data "$out/h1024/data.safetensors" --init "$out/h1024/init.safetensors" \
            --hidden 1024 --batch-size "$2" --steps "${MLP_BIG_STEPS:-100}" --lr 0.001 ;;
        gpt2) echo --model "$out/gpt2" --data "$out/tokens.bin" --block-size 128 --batch-size "$2" \
            --steps "${GPT2_STEPS:-20}" --lr 3e-4 --weight-decay 0.01 --data-seed 1 ;;
    esac
}
batch() { case $1 in mlp_small) echo 32 ;; mlp_big) echo 256 ;; gpt2) echo 8 ;; esac; }
tokens_per_step() { case $1 in gpt2) echo $((8 * 128 * 2)) ;; *) echo 0 ;; esac; }
# FSDP's units: every GPT2Block of gpt2, the mlp's three Linear layers.
units() { case $1 in gpt2) echo GPT2Block ;; *) echo l1,l2,l3 ;; esac; }

# run_one WORKLOAD COLUMN LOG: one run; its output in LOG.
run_one() {
    local w=$1 c=$2 log=$3 port=$((29600 + RANDOM % 300)) b prog=$rel/mlp extra=() log_env=()
    b=$(batch "$w")
    [ "$w" = gpt2 ] && prog=$rel/clm
    [ "$w" = gpt2 ] || extra=(--optimizer sgd)
    # shellcheck disable=SC2046
    case $c in
        peer | peer_fsdp | peer_fp16 | peer_powersgd)
            local script=$mlp_peer flags=()
            [ "$w" = gpt2 ] && script="$gpt2_peer train"
            [ "$c" = peer_fsdp ] && flags=(--fsdp)
            [ "$c" = peer_fp16 ] && flags=(--comm-hook fp16)
            [ "$c" = peer_powersgd ] && flags=(--comm-hook power_sgd --comm-state '{"start_powerSGD_iter": 2}' --bucket-cap-mb 1000)
            torchrun --nproc_per_node 2 --master_port $port $script $(args "$w" "$b") "${flags[@]}" ;;
        single)
            "$prog" $(args "$w" $((2 * b))) "${extra[@]}" ;;
        pair)
            # Two one-thread processes at once, each on a rank's batch: the
            # ranks' work with communication for free (their mean).
            local rates=()
            OMP_NUM_THREADS=1 "$prog" $(args "$w" "$b") "${extra[@]}" >"$log.a" 2>&1 &
            local first=$!
            OMP_NUM_THREADS=1 "$prog" $(args "$w" "$b") "${extra[@]}" >"$log.b" 2>&1
            wait "$first"
            for half in "$log.a" "$log.b"; do
                rates+=("$(grep -oE '[0-9.]+ steps/s' "$half" | tail -1 | cut -d' ' -f1)")
            done
            python -c 'import sys; print(f"pair: {sum(map(float, sys.argv[1:])) / 2:.3f} steps/s")' "${rates[@]}" ;;
        *)
            local flags=()
            case $c in fsdp | fsdp_bf16) flags=(--fsdp_transformer_layer_cls_to_wrap "$(units "$w")") ;; esac
            case $c in ddp | ddp_no_overlap | ddp_fp16 | ddp_powersgd) log_env=(ACCEL_LOG=plugin=debug) ;; esac
            # A line a sync from every rank, for the exposed time of the
            # rank that reached post_backward last (not on the small mlp,
            # whose steps the line would slow by 5-15 %).
            case $c in ddp | ddp_no_overlap) [ "$w" = mlp_small ] || log_env=(ACCEL_LOG=plugin=trace) ;; esac
            env "${log_env[@]}" "$rel/accel" launch -q --config_file "$out/$c.yaml" "${flags[@]}" \
                "$prog" $(args "$w" "$b") "${extra[@]}" ;;
    esac >"$log" 2>&1 || { cat "$log" >&2; echo "throughput.sh: $w under $c failed" >&2; exit 1; }
}

# --- competing load -----------------------------------------------------------
hogs=()
stop_hogs() { for p in "${hogs[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap stop_hogs EXIT
if [ "$load" = 1 ]; then
    for _ in $(seq "$(nproc)"); do python -c 'while True: pass' & hogs+=($!); done
fi

: >"$out/throughput.jsonl"
for w in $workloads; do
    echo "== $w: ${columns[*]} x $repeats (load=$load)"
    for r in $(seq "$repeats"); do
        for c in "${columns[@]}"; do
            log="$out/$w.$c.$r.log"
            run_one "$w" "$c" "$log"
            python - "$w" "$c" "$r" "$log" "$(tokens_per_step "$w")" "$load" <<'PY' | tee -a "$out/throughput.jsonl"
import json, re, sys
w, c, r, log, tps, load = sys.argv[1:]
text = open(log).read()
sps = [float(x) for x in re.findall(r"([\d.]+) steps/s", text)]
if not sps:
    sys.exit(f"{log}: no steps/s line:\n{text}")
row = {"workload": w, "column": c, "run": int(r), "load": int(load), "steps_per_s": sps[-1]}
if int(tps):
    row["tokens_per_s"] = round(sps[-1] * int(tps))
# The ddp plugin's debug line of totals (one per rank): the mean
# communication time per synced step left after backward.
means = re.findall(r"mean ([\d.]+) ms over (\d+) syncs", text)
if means:
    syncs = max(int(n) for _, n in means)
    row["comm_ms_per_step"] = next(float(m) for m, n in means if int(n) == syncs)
# Its trace lines (one per rank and sync): per sync the shortest wait of any
# rank, the one that came last, whose wait holds no wait for another rank;
# their mean from the second sync on (the first rebuilds the buckets).
waits = {}
for rank, n, ms in re.findall(r"rank (\d+) sync (\d+): .* communicated ([\d.]+) ms", text):
    waits.setdefault(int(n), {})[int(rank)] = float(ms)
later = [min(w.values()) for n, w in sorted(waits.items()) if n > 1 and len(w) > 1]
if later:
    row["exposed_ms_per_step"] = round(sum(later) / len(later), 3)
print(json.dumps(row))
PY
        done
    done
done

python - "$out/throughput.jsonl" "$load" <<'PY' | tee "$out/throughput.md"
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
load = sys.argv[2] == "1"
names = {"ddp": "accel DDP", "ddp_no_overlap": "accel DDP, no overlap",
         "ddp_fp16": "accel DDP, comm_hook fp16", "ddp_powersgd": "accel DDP, PowerSGD rank 1",
         "fsdp": "accel FSDP FULL_SHARD", "zero3": "accel ZeRO-3",
         "fsdp_bf16": "accel FSDP FULL_SHARD, bf16", "zero3_bf16": "accel ZeRO-3, bf16",
         "zero3_bucket": "accel ZeRO-3, reduce_bucket_size 5e8",
         "zero3_reuse": "accel ZeRO-3, stage3_max_reuse_distance 1e9", "zero1": "accel ZeRO-1",
         "zero1_no_overlap": "accel ZeRO-1, no overlap",
         "zero1_modules": "accel ZeRO-1, a bucket per module", "peer": "Python Accelerate DDP",
         "peer_fsdp": "PyTorch FSDP2 FULL_SHARD",
         "peer_fp16": "Python Accelerate DDP, comm_hook fp16",
         "peer_powersgd": "Python Accelerate DDP, PowerSGD rank 1", "single": "one process, global batch",
         "pair": "two one-thread processes at once, a rank's batch each"}
# Only the columns this run measured.
names = {c: n for c, n in names.items() if any(r["column"] == c for r in rows)}
work = {"mlp_small": "mlp h128 b32", "mlp_big": "mlp h1024 b256", "gpt2": "gpt2 6x384 b8 block128"}
def med(w, c, key="steps_per_s"):
    vals = [r[key] for r in rows if r["workload"] == w and r["column"] == c and key in r]
    return statistics.median(vals) if vals else None
print(f"2 CPU ranks{', one competing CPU-bound process per core' if load else ', quiet machine'}; "
      "median steps/s of the runs (× Python Accelerate DDP; the sharded columns also × their own "
      "side's DDP, and accel FSDP × PyTorch FSDP2)\n")
print("| workload | " + " | ".join(names.values()) + " | DDP all-reduce exposed after backward |")
print("|---" * (len(names) + 2) + "|")
for w in work:
    if not any(r["workload"] == w for r in rows):
        continue
    peer, ddp, single, pair = med(w, "peer"), med(w, "ddp"), med(w, "single"), med(w, "pair")
    peer_fsdp, peer_fp16, peer_powersgd = med(w, "peer_fsdp"), med(w, "peer_fp16"), med(w, "peer_powersgd")
    def cell(c):
        v = med(w, c)
        if v is None:
            return "-"
        ratios = [f"{v / peer:.2f}×"] if peer and c != "peer" else []
        if c.startswith(("fsdp", "zero")) and ddp:
            ratios.append(f"{v / ddp:.2f}× DDP")
        if c == "fsdp" and peer_fsdp:
            ratios.append(f"{v / peer_fsdp:.2f}× FSDP2")
        if c == "peer_fsdp" and peer:
            ratios = [f"{v / peer:.2f}× DDP"]
        hooked = {"ddp_fp16": peer_fp16, "ddp_powersgd": peer_powersgd}
        if hooked.get(c):
            ratios.append(f"{v / hooked[c]:.2f}× its peer")
        if c in hooked and ddp:
            ratios.append(f"{v / ddp:.2f}× DDP")
        if c == "ddp" and single:
            ratios.append(f"{v / single:.0%} of one process")
        if c == "ddp" and pair:
            ratios.append(f"{v / pair:.0%} of two")
        # Three decimals below 10 steps/s, as gpt2 prints them.
        return (f"{v:.2f}" if v >= 10 else f"{v:.3f}") + (f" ({', '.join(ratios)})" if ratios else "")
    # The later rank's wait where the runs logged it, else the first rank's.
    key = "exposed_ms_per_step" if med(w, "ddp", "exposed_ms_per_step") is not None else "comm_ms_per_step"
    on, off = med(w, "ddp", key), med(w, "ddp_no_overlap", key)
    exposed = f"{on:.1f} of {off:.1f} ms ({on / off:.0%})" if on is not None and off else "-"
    if key == "comm_ms_per_step" and on is not None:
        exposed += " (first rank)"
    print(f"| {work[w]} | " + " | ".join(cell(c) for c in names) + f" | {exposed} |")
PY

if [ "${UPDATE_BENCHMARKS:-0}" = 1 ]; then
    python - "$out/throughput.md" "$load" <<'PY'
import sys
table, load = open(sys.argv[1]).read(), sys.argv[2]
tag = "throughput-load" if load == "1" else "throughput"
begin, end = f"<!-- {tag}: written by benches/throughput.sh -->", f"<!-- end {tag} -->"
text = open("BENCHMARKS.md").read()
block = f"{begin}\n{table}{end}"
if begin in text:
    a = text.index(begin)
    b = text.index(end, a) + len(end)
    text = text[:a] + block + text[b:]
else:
    text = text.rstrip("\n") + "\n\n" + block + "\n"
open("BENCHMARKS.md", "w").write(text)
PY
fi
