#!/usr/bin/env bash
# Peak resident memory per rank for a model bigger than a rank's share:
# accel's gpt2 example loading a 210 M-parameter GPT-2 (16 layers x 1024,
# 16 heads, vocab 8192, positions 128; random init written by transformers)
# and taking 2 AdamW steps on 4 CPU ranks under DDP, ZeRO-1/2/3 and FSDP
# FULL_SHARD (GPT2Block units) -- ZeRO-3 with and without zero3_init_flag,
# FSDP with and without fsdp_cpu_ram_efficient_loading (each rank maps the
# checkpoint and reads only its slices) -- and, for the sharded rows, with
# the sharding engine's `release_freed_memory` (on by default when
# parameters are sharded) set the other way; then a LoRA fine-tune of the
# same model (`--lora-r 8`) under DDP, ZeRO-3 and FSDP.
#
# The figure is the largest VmHWM (from /proc, polled every 0.2 s) of any
# rank of the run. It needs about 24 GB of memory (DDP: 4 x 5 GB).
#
# Usage: bash benches/memory.sh [OUT_DIR]   (needs scripts/bootstrap.sh first)
source "$(dirname "$0")/common.sh" target/bench-results/memory "${1:-}"
cargo build --release -q -p accel-cli -p accel-ddp -p accel-fsdp -p accel-zero -p accel-drivers
rel=$PWD/target/release

[ -d "$out/model" ] || python - "$out/model" <<'PY'
import sys, torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
GPT2LMHeadModel(GPT2Config(n_layer=16, n_embd=1024, n_head=16, vocab_size=8192,
                           n_positions=128)).save_pretrained(sys.argv[1])
PY
[ -f "$out/tokens.bin" ] || python - "$out/tokens.bin" <<'PY'
import sys, numpy as np
np.random.default_rng(0).integers(0, 8192, 200_000, dtype=np.uint16).tofile(sys.argv[1])
PY

config() {  # name distributed_type [yaml lines]
    local name=$1 kind=$2; shift 2
    { printf 'distributed_type: %s\nnum_processes: 4\nuse_cpu: true\n' "$kind"
      printf '%s\n' "$@"; } >"$out/$name.yaml"
}
config ddp MULTI_CPU
for stage in 1 2 3; do config "zero$stage" DEEPSPEED deepspeed_config: "  zero_stage: $stage"; done
config zero3-init-flag DEEPSPEED deepspeed_config: "  zero_stage: 3" "  zero3_init_flag: true"
for efficient in false true; do
    config "fsdp-efficient-loading-$efficient" FSDP fsdp_config: "  fsdp_sharding_strategy: FULL_SHARD" \
        "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP" "  fsdp_transformer_layer_cls_to_wrap: GPT2Block" \
        "  fsdp_cpu_ram_efficient_loading: $efficient"
done

# Runs one job, polling the peak RSS of its gpt2 ranks; prints the kB.
# Extra arguments go to gpt2 (and name the log: `ddp-lora-r-8.log`).
peak() {
    local cfg=$1; shift
    local tag; tag=$(printf -- '-%s' "$@" | tr -s ' -' '-')
    peak_rss "$out/$cfg${*:+$tag}.log" "$rel/clm" \
        "$rel/accel" launch -q --config_file "$out/$cfg.yaml" "$rel/clm" --model "$out/model" \
        --data "$out/tokens.bin" --block-size 128 --batch-size 2 --steps 2 --lr 3e-4 "$@"
}

# The same config with the engine's release_freed_memory set to $2.
flipped() {  # name true|false
    local plugin=accel-zero
    case $1 in fsdp*) plugin=accel-fsdp ;; esac
    { cat "$out/$1.yaml"; printf 'accel:\n  plugins:\n    %s:\n      release_freed_memory: %s\n' "$plugin" "$2"; } \
        >"$out/$1-release-$2.yaml"
    echo "$1-release-$2"
}

printf '| strategy | peak RSS per rank | x DDP | release_freed_memory flipped | peak RSS | x DDP |\n| --- | --- | --- | --- | --- | --- |\n'
ddp=$(peak ddp)
row() {  # name kB [flipped-to kB]
    python3 -c "import sys; a=sys.argv; d=int(a[2]); p=int(a[3]); f=f'{a[4]} | {int(a[5])/1048576:.2f} GiB | {int(a[5])/d:.2f}' if len(a) > 5 else ' | | '; print(f'| {a[1]} | {p/1048576:.2f} GiB | {p/d:.2f} | {f} |')" \
        "$1" "$ddp" "${@:2}"
}
row ddp "$ddp"
for cfg in zero1 zero2; do
    row "$cfg" "$(peak "$cfg")" true "$(peak "$(flipped "$cfg" true)")"
done
for cfg in zero3 zero3-init-flag fsdp-efficient-loading-false fsdp-efficient-loading-true; do
    row "$cfg" "$(peak "$cfg")" false "$(peak "$(flipped "$cfg" false)")"
done

# LoRA (rank-8 adapters beside every c_attn, the base frozen): the sharded
# strategies free each block once its input's gradient is in.
printf '\nLoRA, `--lora-r 8`:\n\n| strategy | peak RSS per rank | x DDP |\n| --- | --- | --- |\n'
ddp=$(peak ddp --lora-r 8)
for cfg in ddp zero3 fsdp-efficient-loading-true; do
    if [ "$cfg" = ddp ]; then kb=$ddp; else kb=$(peak "$cfg" --lora-r 8); fi
    python3 -c "import sys; d, p = int(sys.argv[2]), int(sys.argv[3]); print(f'| {sys.argv[1]} | {p/1048576:.2f} GiB | {p/d:.2f} |')" "$cfg" "$ddp" "$kb"
done
