"""accel's `mlp` in Python Accelerate, for side-by-side runs.

torchrun --nproc_per_node 2 accelerate_mlp.py --data D --init I --hidden H \
    --batch-size B --steps N --lr LR --loss-log FILE [--fsdp] [--comm-hook no|fp16|bf16|power_sgd] [--comm-state JSON] [--bucket-cap-mb X]
Same model, data order (Accelerate's batch sharding, no shuffle), plain SGD
and per-step mean loss across ranks as `mlp --loss-log` (averaged across
ranks in one all-reduce every 20 steps, as mlp does); prints steps/s.

--fsdp: PyTorch's FSDP2 (`fully_shard`, FULL_SHARD: resharded after
forward) on l1, l2, l3 and the root instead of DDP, the units accel's FSDP
column wraps. Accelerate turns FSDP off on a CPU-only machine (it falls
back to MULTI_CPU, i.e. DDP), and FSDP1 refuses to run without an
accelerator, so the model is sharded by torch itself and Accelerate
prepares only the optimizer and the data.

--comm-hook: DDP's communication hook, as Accelerate users set it
(DistributedDataParallelKwargs(comm_hook=...): PyTorch's fp16_compress_hook /
bf16_compress_hook / powerSGD_hook), the peer of accel-ddp's `comm_hook`;
--comm-state: its comm_state_option (PowerSGDState's options), JSON.
--bucket-cap-mb: DDP's.
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--data")
p.add_argument("--init")
p.add_argument("--hidden", type=int)
p.add_argument("--batch-size", type=int)
p.add_argument("--steps", type=int)
p.add_argument("--lr", type=float)
p.add_argument("--loss-log")
p.add_argument("--fsdp", action="store_true")
p.add_argument("--comm-hook", default="no", choices=["no", "fp16", "bf16", "power_sgd"])
p.add_argument("--comm-state", default="{}")
p.add_argument("--bucket-cap-mb", type=float)
a = p.parse_args()


class Mlp(torch.nn.Module):
    def __init__(self, d, h, o):
        super().__init__()
        self.l1, self.l2, self.l3 = torch.nn.Linear(d, h), torch.nn.Linear(h, h), torch.nn.Linear(h, o)

    def forward(self, x):
        return self.l3(F.relu(self.l2(F.relu(self.l1(x)))))


acc = Accelerator(
    kwargs_handlers=[
        DistributedDataParallelKwargs(
            comm_hook=DDPCommunicationHookType(a.comm_hook),
            comm_state_option=json.loads(a.comm_state),
            **({} if a.bucket_cap_mb is None else {"bucket_cap_mb": a.bucket_cap_mb}),
        )
    ]
)
data = load_file(a.data)
model = Mlp(data["x"].shape[1], a.hidden, data["y"].shape[1])
model.load_state_dict(load_file(a.init))
loader = DataLoader(TensorDataset(data["x"], data["y"]), batch_size=a.batch_size, shuffle=False)
if a.fsdp:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (acc.num_processes,))
    for unit in (model.l1, model.l2, model.l3, model):
        fully_shard(unit, mesh=mesh)
# After sharding: the optimizer steps on the sharded parameters.
opt = torch.optim.SGD(model.parameters(), lr=a.lr)
if a.fsdp:
    opt, loader = acc.prepare(opt, loader)
else:
    model, opt, loader = acc.prepare(model, opt, loader)

log = open(a.loss_log, "w") if acc.is_main_process and a.loss_log else None
REPORT_EVERY = 20  # as mlp: one all-reduce of the step losses every 20 steps
step, first, last, pending = 0, None, None, []


def report():
    global first, last
    means = acc.reduce(torch.stack(pending), "mean").tolist()
    for i, mean in enumerate(means):
        first = mean if first is None else first
        last = mean
        if log:
            log.write(json.dumps({"step": step - len(means) + 1 + i, "loss": mean}) + "\n")
    pending.clear()


start = time.perf_counter()
while step < a.steps:
    for x, y in loader:
        loss = F.mse_loss(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        step += 1
        pending.append(loss.detach())
        if len(pending) == REPORT_EVERY or step == a.steps:
            report()
        if step == a.steps:
            break
secs = time.perf_counter() - start
if log:
    log.close()
acc.print(f"accelerate: {step} steps, loss {first:.6f} -> {last:.6f}, {step / secs:.1f} steps/s")
# The results are out: leave without Python's teardown, where gloo's
# threads (FSDP2's above all, and DDP's under load) can outlive the process
# group and abort the rank ("terminate called without an active
# exception", SIGABRT), failing the run after it measured.
acc.end_training()
sys.stdout.flush()
os._exit(0)
