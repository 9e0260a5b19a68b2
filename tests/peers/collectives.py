"""Reference: Accelerate's collectives, run under torchrun (gloo on CPU).

Writes rank<RANK>.json into argv[1] with the same keys the Rust
collectives-probe writes.
"""
import json
import os
import sys

import torch
from accelerate import Accelerator
from gloo_exit import leave
from torch.utils.data import DataLoader, TensorDataset

acc = Accelerator(cpu=True)
r = acc.process_index
t = torch.arange(3, dtype=torch.float32) + 10 * r
out = {
    "gather": acc.gather(t).tolist(),
    "sum": acc.reduce(t.clone(), reduction="sum").tolist(),
    "mean": acc.reduce(t.clone(), reduction="mean").tolist(),
}
from accelerate.utils import broadcast

out["broadcast"] = broadcast(t.clone(), from_process=0).tolist()
ragged = torch.arange(r + 1, dtype=torch.float32) + 100 * r
out["pad_gather"] = acc.gather(acc.pad_across_processes(ragged, dim=0, pad_index=-1)).tolist()
loader = acc.prepare(DataLoader(TensorDataset(torch.arange(10, dtype=torch.float32)), batch_size=2))
metrics = []
for (xb,) in loader:
    metrics += acc.gather_for_metrics(xb).tolist()
out["metrics"] = metrics
# Nobody raised the flag; the last rank raises it; a yes lowers it.
trigger = [acc.check_trigger()]
if r == acc.num_processes - 1:
    acc.set_trigger()
trigger.append(acc.check_trigger())
trigger.append(acc.check_trigger())
out["trigger"] = trigger
# Empty tensors: nothing to reduce or gather, and no error.
empty = torch.zeros(0)
out["empty_sum"] = acc.reduce(empty.clone(), reduction="sum").tolist()
out["empty_gather"] = acc.gather(empty.clone()).tolist()
# 16-bit tensors: gathered and broadcast bit for bit, summed and averaged
# as 16-bit values (gloo adds them in float, rounded back).
for name, dtype in [("half", torch.float16), ("bf16", torch.bfloat16)]:
    exact = (torch.arange(4, dtype=torch.float32) * 0.25 + 0.5 * r).to(dtype)
    rounding = (torch.arange(6, dtype=torch.float32) * 0.013 + (0.1 + 0.37 * r)).to(dtype)
    tiny = torch.tensor([-0.0, 6e-8, 1e-40, 3e4], dtype=torch.float32).to(dtype)
    out[f"gather_{name}"] = acc.gather(torch.cat([rounding, tiny])).tolist()
    out[f"broadcast_{name}"] = broadcast(rounding.clone(), from_process=0).tolist()
    for key, t in [("exact", exact), ("rounding", rounding)]:
        out[f"sum_{name}_{key}"] = acc.reduce(t.clone(), reduction="sum").tolist()
        out[f"mean_{name}_{key}"] = acc.reduce(t.clone(), reduction="mean").tolist()
    world = acc.num_processes
    if world > 1:
        # FSDP2's 16-bit gradient reduce-scatter on gloo: divided by the
        # world size (2 ranks: all of it before), then summed.
        inp = (torch.arange(3 * world, dtype=torch.float32) * 0.013 + (0.1 + 0.37 * r)).to(dtype)
        block = torch.zeros(3, dtype=dtype)
        torch.distributed.reduce_scatter_tensor(block, inp / world, op=torch.distributed.ReduceOp.SUM)
        out[f"reduce_scatter_{name}"] = block.tolist()
with open(os.path.join(sys.argv[1], f"rank{r}.json"), "w") as f:
    json.dump(out, f)
leave(acc.wait_for_everyone)
