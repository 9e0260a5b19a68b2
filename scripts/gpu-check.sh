#!/usr/bin/env bash
# gpu-check: what can only be checked on a machine with a CUDA GPU.
#
#   bash scripts/gpu-check.sh [OUT_DIR]      (default target/gpu-check-results)
#
# On a machine without a CUDA GPU it says so and exits 0. With one it
#  1. builds accel, its strategy plugins and the examples (release, in
#     target/gpu-check so the usual target/ is left alone) against the torch
#     that python finds there (LIBTORCH = that torch's directory; when its
#     version is not the one tch expects, LIBTORCH_BYPASS_VERSION_CHECK=1,
#     and it says so);
#  2. trains the mlp and gpt2 examples through `accel launch` on the GPU in
#     fp32, bf16 and fp16, and on the CPU in fp32 (--cpu), and compares each
#     GPU run's final loss with the CPU's within a tolerance per precision;
#  3. trains mlp under FSDP on one CUDA rank, through an NCCL communicator of
#     world size 1, against the CPU; with 2 GPUs or more, also trains both on
#     2 ranks with --multi_gpu (NCCL) and compares with 2 CPU ranks (DDP over MPI);
#  4. reports gpt2 tokens/s beside transformers + Python Accelerate on the
#     same GPU, model, data and precision (tests/peers/clm_reference.py).
# It prints a table, and exits 1 when a loss is outside its tolerance or a
# run fails.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/gpu-check-results}

python=${PYTHON:-}
if [ -z "$python" ]; then
    if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=$(command -v python3 || true); fi
fi

no_gpu() {
    echo "gpu-check: no CUDA GPU on this machine ($1): nothing to check here, which is not a failure;"
    echo "gpu-check: run it where nvidia-smi lists a GPU and torch.cuda.is_available() is True"
    exit 0
}

# --- 0. Is there a GPU? ------------------------------------------------------
command -v nvidia-smi >/dev/null 2>&1 || no_gpu "nvidia-smi is not installed"
if ! listing=$(nvidia-smi -L 2>&1); then
    no_gpu "nvidia-smi -L failed: $(echo "$listing" | head -1)"
fi
gpus=$(echo "$listing" | grep -c '^GPU [0-9]' || true)
[ "$gpus" -gt 0 ] || no_gpu "nvidia-smi lists no GPU"
echo "gpu-check: nvidia-smi lists $gpus GPU(s):"
while IFS= read -r line; do echo "  $line"; done <<<"$listing"

if [ -z "$python" ]; then
    echo "gpu-check: error: a GPU is here but no python to find torch with (set PYTHON, or run scripts/bootstrap.sh)" >&2
    exit 1
fi
if ! info=$("$python" - <<'PY' 2>&1
import os, torch
print(os.path.dirname(torch.__file__))
print(torch.__version__.split("+")[0])
print(torch.version.cuda or "none")
print(torch.cuda.is_available())
print(torch.cuda.device_count())
PY
); then
    echo "gpu-check: error: $python cannot import torch: $(echo "$info" | tail -1)" >&2
    exit 1
fi
{ read -r torch_dir; read -r torch_version; read -r torch_cuda; read -r cuda_ok; read -r cuda_count; } <<<"$info"
if [ "$cuda_ok" != "True" ]; then
    echo "gpu-check: error: nvidia-smi lists $gpus GPU(s), but torch $torch_version at $torch_dir" \
        "cannot use them (torch.cuda.is_available() is False; CUDA build: $torch_cuda):" \
        "install a CUDA build of torch, or check the driver" >&2
    exit 1
fi
echo "gpu-check: torch $torch_version (CUDA $torch_cuda) at $torch_dir sees $cuda_count GPU(s)"

# --- 1. Build against that torch -----------------------------------------------
expected=$(sed -n 's/^torch==//p' scripts/requirements.txt)
export LIBTORCH=$torch_dir LIBTORCH_CXX11_ABI=1
if [ "$torch_version" != "$expected" ]; then
    export LIBTORCH_BYPASS_VERSION_CHECK=1
    echo "gpu-check: torch $torch_version is not the $expected tch expects:" \
        "building with LIBTORCH_BYPASS_VERSION_CHECK=1"
else
    echo "gpu-check: torch $torch_version is the version tch expects"
fi
export CARGO_TARGET_DIR=$PWD/target/gpu-check
echo "gpu-check: cargo build --release (LIBTORCH=$LIBTORCH, CARGO_TARGET_DIR=$CARGO_TARGET_DIR)"
cargo build --release -q -p accel-cli -p accel-ddp -p accel-fsdp -p accel-zero -p accel-drivers
rel=$CARGO_TARGET_DIR/release
accel=$rel/accel
mkdir -p "$out"

# --- helpers -------------------------------------------------------------------
failures=0
rows=()

# final_loss FILE: the loss of the last line of a --loss-log file.
final_loss() { "$python" -c 'import json,sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])["loss"])' "$1"; }

# steps_per_s LOG: the steps/s of the summary line of a run's output.
steps_per_s() { grep -oE '[0-9.]+ steps/s' "$1" | tail -1 | grep -oE '^[0-9.]+' || echo 0; }

# tolerance PRECISION: relative tolerance of a GPU loss against the CPU's.
tolerance() { case $1 in no) echo 0.001 ;; fp16) echo 0.05 ;; bf16) echo 0.1 ;; esac; }

# run NAME LOG CMD...: runs CMD, output to LOG; on failure shows the log.
run() {
    local name=$1 log=$2; shift 2
    echo "== $name"
    local status=0
    "$@" >"$log" 2>&1 || status=$?
    if [ "$status" -ne 0 ]; then
        echo "gpu-check: FAILED: $name (exit status $status); its output:" >&2
        sed 's/^/  /' "$log" >&2
        failures=$((failures + 1))
        return 1
    fi
}

# compare NAME PRECISION GPU_LOSSLOG CPU_LOSSLOG TOKENS_PER_S: adds a row.
compare() {
    local name=$1 prec=$2 gpu=$3 cpu=$4 tps=$5 verdict
    local a b tol
    a=$(final_loss "$gpu"); b=$(final_loss "$cpu"); tol=$(tolerance "$prec")
    if "$python" -c 'import sys; a,b,t=map(float,sys.argv[1:]); sys.exit(0 if abs(a-b) <= 1e-3 + t*abs(b) else 1)' "$a" "$b" "$tol"; then
        verdict=ok
    else
        verdict="FAILED (beyond 1e-3 + $tol x CPU)"
        failures=$((failures + 1))
    fi
    rows+=("$(printf '%-34s %-6s %12.6f %12.6f %10s  %s' "$name" "$prec" "$a" "$b" "$tps" "$verdict")")
}

# --- 2. mlp and gpt2 on one GPU against the CPU ---------------------------------
mlp_args=(--steps 200 --hidden 64 --seed 0)
run "mlp, CPU fp32" "$out/mlp_cpu.log" \
    "$accel" launch -q --cpu --num_processes 1 "$rel/mlp" "${mlp_args[@]}" \
    --mixed-precision no --loss-log "$out/mlp_cpu.jsonl" || true
for prec in no bf16 fp16; do
    run "mlp, CUDA $prec" "$out/mlp_cuda_$prec.log" \
        "$accel" launch -q --num_processes 1 --gpu_ids 0 "$rel/mlp" "${mlp_args[@]}" \
        --mixed-precision "$prec" --loss-log "$out/mlp_cuda_$prec.jsonl" &&
        [ -s "$out/mlp_cpu.jsonl" ] &&
        compare "mlp, 1 GPU" "$prec" "$out/mlp_cuda_$prec.jsonl" "$out/mlp_cpu.jsonl" "-"
done

peer=tests/peers/clm_reference.py
batch=8 block=128
[ -d "$out/model" ] || "$python" "$peer" init "$out/model" --n-layer 4 --n-embd 256 --n-head 4 \
    --vocab-size 8192 --n-positions 256 --seed 0
[ -f "$out/tokens.bin" ] || "$python" - "$out/tokens.bin" <<'PY'
import sys, numpy as np
np.random.default_rng(0).integers(0, 8192, 1_000_000, dtype=np.uint16).tofile(sys.argv[1])
PY
gpt2_args=(--model "$out/model" --data "$out/tokens.bin" --block-size "$block" --batch-size "$batch"
    --steps 30 --lr 3e-4 --data-seed 1)
# tokens/s over RANKS ranks from a run's log.
tokens_per_s() { "$python" -c 'import sys; s,b,k,r=map(float,sys.argv[1:]); print(round(s*b*k*r))' "$(steps_per_s "$1")" $batch $block "$2"; }
run "gpt2, CPU fp32" "$out/gpt2_cpu.log" \
    "$accel" launch -q --cpu --num_processes 1 "$rel/clm" "${gpt2_args[@]}" \
    --mixed-precision no --loss-log "$out/gpt2_cpu.jsonl" || true
for prec in no bf16 fp16; do
    if run "gpt2, CUDA $prec" "$out/gpt2_cuda_$prec.log" \
        "$accel" launch -q --num_processes 1 --gpu_ids 0 "$rel/clm" "${gpt2_args[@]}" \
        --mixed-precision "$prec" --loss-log "$out/gpt2_cuda_$prec.jsonl" && [ -s "$out/gpt2_cpu.jsonl" ]; then
        compare "gpt2, 1 GPU" "$prec" "$out/gpt2_cuda_$prec.jsonl" "$out/gpt2_cpu.jsonl" \
            "$(tokens_per_s "$out/gpt2_cuda_$prec.log" 1)"
    fi
    # Python Accelerate on the same GPU, model, data and precision.
    if run "gpt2, transformers + Accelerate, CUDA $prec" "$out/peer_cuda_$prec.log" \
        "$python" "$peer" train "${gpt2_args[@]}" --cuda --mixed-precision "$prec" \
        --loss-log "$out/peer_cuda_$prec.jsonl"; then
        rows+=("$(printf '%-34s %-6s %12.6f %12s %10s  %s' "gpt2, Python Accelerate, 1 GPU" "$prec" \
            "$(final_loss "$out/peer_cuda_$prec.jsonl")" "-" "$(tokens_per_s "$out/peer_cuda_$prec.log" 1)" "(peer)")")
    fi
done

# --- 3. NCCL --------------------------------------------------------------------
if [ "$cuda_count" -ge 2 ]; then
    run "mlp, 2 CPU ranks (DDP over MPI)" "$out/mlp_cpu2.log" \
        "$accel" launch -q --cpu --num_processes 2 "$rel/mlp" "${mlp_args[@]}" \
        --mixed-precision no --loss-log "$out/mlp_cpu2.jsonl" || true
    run "mlp, 2 GPU ranks (DDP over NCCL)" "$out/mlp_nccl.log" \
        "$accel" launch -q --multi_gpu --num_processes 2 --gpu_ids 0,1 "$rel/mlp" "${mlp_args[@]}" \
        --mixed-precision no --loss-log "$out/mlp_nccl.jsonl" && [ -s "$out/mlp_cpu2.jsonl" ] &&
        compare "mlp, 2 GPUs (NCCL)" no "$out/mlp_nccl.jsonl" "$out/mlp_cpu2.jsonl" "-"
    run "gpt2, 2 GPU ranks (DDP over NCCL), bf16" "$out/gpt2_nccl.log" \
        "$accel" launch -q --multi_gpu --num_processes 2 --gpu_ids 0,1 "$rel/clm" "${gpt2_args[@]}" \
        --mixed-precision bf16 --loss-log "$out/gpt2_nccl.jsonl" &&
        rows+=("$(printf '%-34s %-6s %12.6f %12s %10s  %s' "gpt2, 2 GPUs (NCCL)" bf16 \
            "$(final_loss "$out/gpt2_nccl.jsonl")" "-" "$(tokens_per_s "$out/gpt2_nccl.log" 2)" "ran")")
    torchrun=$(dirname "$python")/torchrun
    run "gpt2, transformers + Accelerate, 2 GPUs (torchrun, NCCL), bf16" "$out/peer_nccl.log" \
        "$torchrun" --nproc_per_node 2 --master_port 29547 "$peer" train "${gpt2_args[@]}" \
        --cuda --mixed-precision bf16 --loss-log "$out/peer_nccl.jsonl" &&
        rows+=("$(printf '%-34s %-6s %12.6f %12s %10s  %s' "gpt2, Python Accelerate, 2 GPUs" bf16 \
            "$(final_loss "$out/peer_nccl.jsonl")" "-" "$(tokens_per_s "$out/peer_nccl.log" 2)" "(peer)")")
fi
# NCCL with a world of one rank (every machine with a GPU): FSDP FULL_SHARD on
# one CUDA rank that `accel launch` started opens an NCCL communicator of one
# (as Accelerate's launcher does through torchrun), so its all-gathers and
# reduce-scatters go through NCCL; the loss must match the CPU's.
cat >"$out/fsdp1.yaml" <<'YAML'
distributed_type: FSDP
num_processes: 1
fsdp_config:
  fsdp_sharding_strategy: FULL_SHARD
YAML
if run "mlp, FSDP on 1 GPU rank (NCCL, world size 1)" "$out/mlp_nccl1.log" \
    "$accel" launch -q --config_file "$out/fsdp1.yaml" --gpu_ids 0 "$rel/mlp" "${mlp_args[@]}" \
    --mixed-precision no --loss-log "$out/mlp_nccl1.jsonl"; then
    [ -s "$out/mlp_cpu.jsonl" ] &&
        compare "mlp, FSDP, 1 GPU (NCCL of 1)" no "$out/mlp_nccl1.jsonl" "$out/mlp_cpu.jsonl" "-"
fi

# --- 4. Report ------------------------------------------------------------------
echo
printf '%-34s %-6s %12s %12s %10s  %s\n' run prec "final loss" "CPU loss" tokens/s verdict
for r in "${rows[@]}"; do echo "$r"; done
echo "(logs and loss logs: $out)"
if [ "$failures" -gt 0 ]; then
    echo "gpu-check: $failures check(s) FAILED" >&2
    exit 1
fi
echo "gpu-check: every GPU run agrees with the CPU"
