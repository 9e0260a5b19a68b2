# What the bench scripts share. Each one starts with
#   source "$(dirname "$0")/common.sh" DEFAULT_OUT "${1:-}"
# which stops the script at its first error, moves to the repository root
# with the project's venv first on PATH, and sets `out`, the results
# directory (made): the script's OUT_DIR argument when given, else
# DEFAULT_OUT.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${2:-$1}
mkdir -p "$out"
export PATH="$PWD/.venv/bin:$PATH"

# peak_rss LOG MATCH COMMAND...: runs COMMAND (its output into LOG) while
# polling, every 0.2 s, the peak RSS (VmHWM, kB) of the processes whose
# command line contains MATCH; prints the largest. When COMMAND fails, LOG
# goes to stderr and peak_rss fails.
peak_rss() {
    local log=$1 match=$2; shift 2
    "$@" >"$log" 2>&1 &
    local pid=$! peak=0
    while kill -0 "$pid" 2>/dev/null; do
        for s in /proc/[0-9]*/status; do
            local p=${s#/proc/}; p=${p%/status}
            if { tr '\0' ' ' <"/proc/$p/cmdline"; } 2>/dev/null | grep -q -- "$match"; then
                local kb; kb=$(awk '/^VmHWM:/ {print $2}' "$s" 2>/dev/null || true)
                if [ -n "$kb" ] && [ "$kb" -gt "$peak" ]; then peak=$kb; fi
            fi
        done
        sleep 0.2
    done
    wait "$pid" || { cat "$log" >&2; return 1; }
    echo "$peak"
}

# llama_4x256 DIR: the transformers-made Llama that llama.sh and trainer.sh
# train (4 layers x 256 hidden, 4 heads / 2 key-value heads, intermediate
# 688, vocab 8192) with a byte-level BPE tokenizer, made once in DIR.
llama_4x256() {
    local config='{"model_type": "llama", "vocab_size": 8192, "hidden_size": 256, "intermediate_size": 688,
      "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
      "max_position_embeddings": 512, "eos_token_id": null, "bos_token_id": null}'
    llama_model "$1" "$config"
}

# llama_model DIR CONFIG_JSON: a transformers-made model of CONFIG_JSON
# (seed 0) with a byte-level BPE tokenizer, made once in DIR.
llama_model() {
    [ -d "$1" ] || { python tests/peers/models_reference.py init "$1" --config "$2" &&
        python tests/peers/models_reference.py tokenizer "$1"; }
}

# word_lines FILE N: N lines of 5 to 30 words drawn from a small vocabulary
# (seed 0), made once in FILE.
word_lines() {
    [ -f "$1" ] || python - "$1" "$2" <<'PY'
import random, sys
random.seed(0)
words = "the cat sat on a mat and a dog ran to the park while accel trains models".split()
with open(sys.argv[1], "w") as f:
    for _ in range(int(sys.argv[2])):
        f.write(" ".join(random.choice(words) for _ in range(random.randint(5, 30))) + "\n")
PY
}
