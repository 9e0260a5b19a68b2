"""DeepSpeed's own loss scaler, driven by a sequence of overflows.

Usage: deepspeed_loss_scale.py DS_CONFIG.json OVERFLOWS.json OUT.json

Builds the scaler exactly as DeepSpeed's ZeRO optimizers do (stage_1_and_2.py
and stage3.py: `CreateLossScaler(dtype, static_loss_scale, dynamic_scaling,
dynamic_loss_args)`, with the engine's `loss_scale`, `dynamic_loss_scale()`
and `dynamic_loss_scale_args()` of the file's `fp16` section read by
`get_float16_config`), then calls `update_scale(overflow)` once per step, as
the optimizer's `step()` does. Writes {"initial": scale, "scales": [scale
after each step], "error_at": step index or null, "error": message}.
"""

import json
import sys

import torch
from deepspeed.runtime.fp16 import loss_scaler
from deepspeed.runtime.precision_config import get_float16_config

# update_scale logs on rank 0 only and asks deepspeed.comm for the rank; this
# one-process run has no process group, and the rank changes nothing else.
loss_scaler.dist.get_rank = lambda *args, **kwargs: 0


def main():
    config_path, overflows_path, out_path = sys.argv[1:]
    with open(config_path) as f:
        fp16 = get_float16_config(json.load(f))
    with open(overflows_path) as f:
        overflows = json.load(f)
    scaler = loss_scaler.CreateLossScaler(
        dtype=torch.half,
        static_loss_scale=fp16.loss_scale,
        dynamic_scaling=fp16.loss_scale == 0,
        dynamic_loss_args=fp16.dynamic_loss_scale_args(),
    )
    result = {"initial": float(scaler.loss_scale), "scales": [], "error_at": None, "error": None}
    for i, overflow in enumerate(overflows):
        try:
            scaler.update_scale(bool(overflow))
        except Exception as e:  # DeepSpeed raises a bare Exception at the floor
            result["error_at"] = i
            result["error"] = str(e)
            break
        result["scales"].append(float(scaler.loss_scale))
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
