"""Reference: one synced backward under Accelerate's DDP with a communication
hook, run under torchrun (gloo on CPU): the peer of grad-probe under
accel-ddp's `comm_hook`.

    torchrun --nproc_per_node N ddp_comm_hook.py INPUTS OUT_DIR HOOK [STEPS [STATE_JSON]]

INPUTS is grad-probe's inputs.safetensors (w1 b1 w2 b2, and x<r> y<r> per
rank); HOOK is a DDPCommunicationHookType value (no, fp16, bf16, power_sgd),
STATE_JSON its comm_state_option (PowerSGDState's options). The model is
tanh(x W1^T + b1) W2^T + b2 with MSE on the rank's rows, prepared by
`Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(comm_hook=HOOK,
comm_state_option=STATE)])` (Accelerate registers PyTorch's
fp16_compress_hook / bf16_compress_hook / powerSGD_hook). STEPS synced
backwards (default 1); each but the last updates the parameters by plain SGD
(p -= 0.1 * grad) and zeroes the gradients, as grad-probe. Writes
OUT_DIR/grads<r>.safetensors, the last step's gradients after the all-reduce.
"""
import json
import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
from gloo_exit import leave
from safetensors.torch import load_file, save_file

NAMES = ["w1", "b1", "w2", "b2"]


class Probe(torch.nn.Module):
    def __init__(self, inputs):
        super().__init__()
        for n in NAMES:
            self.register_parameter(n, torch.nn.Parameter(inputs[n].clone()))

    def forward(self, x):
        return torch.tanh(x @ self.w1.t() + self.b1) @ self.w2.t() + self.b2


inputs_path, out_dir, hook = sys.argv[1:4]
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 1
state = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
inputs = load_file(inputs_path)
kwargs = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType(hook), comm_state_option=state)
acc = Accelerator(cpu=True, kwargs_handlers=[kwargs])
r = acc.process_index
model = acc.prepare(Probe(inputs))
params = [getattr(acc.unwrap_model(model), n) for n in NAMES]
for step in range(1, steps + 1):
    loss = F.mse_loss(model(inputs[f"x{r}"]), inputs[f"y{r}"])
    acc.backward(loss)
    if step < steps:
        with torch.no_grad():
            for p in params:
                p.sub_(p.grad * 0.1)
                p.grad.zero_()
grads = {n: p.grad.contiguous() for n, p in zip(NAMES, params)}
save_file(grads, f"{out_dir}/grads{r}.safetensors")
leave(acc.wait_for_everyone)
