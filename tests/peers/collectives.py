"""Reference: Accelerate's collectives, run under torchrun (gloo on CPU).

Writes rank<RANK>.json into argv[1] with the same keys the Rust
collectives-probe writes.
"""
import json
import os
import sys

import torch
from accelerate import Accelerator
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
with open(os.path.join(sys.argv[1], f"rank{r}.json"), "w") as f:
    json.dump(out, f)
acc.wait_for_everyone()
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
