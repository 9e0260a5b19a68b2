"""Reference: one synced backward under Accelerate's DDP with a communication
hook, run under torchrun (gloo on CPU): the peer of grad-probe under
accel-ddp's `comm_hook`.

    torchrun --nproc_per_node N ddp_comm_hook.py INPUTS OUT_DIR HOOK

INPUTS is grad-probe's inputs.safetensors (w1 b1 w2 b2, and x<r> y<r> per
rank); HOOK is a DDPCommunicationHookType value (no, fp16, bf16). The model
is tanh(x W1^T + b1) W2^T + b2 with MSE on the rank's rows, prepared by
`Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(comm_hook=HOOK)])`
(Accelerate registers PyTorch's fp16_compress_hook / bf16_compress_hook);
writes OUT_DIR/grads<r>.safetensors, the gradients after the all-reduce.
"""
import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
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
inputs = load_file(inputs_path)
kwargs = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType(hook))
acc = Accelerator(cpu=True, kwargs_handlers=[kwargs])
r = acc.process_index
model = acc.prepare(Probe(inputs))
loss = F.mse_loss(model(inputs[f"x{r}"]), inputs[f"y{r}"])
acc.backward(loss)
grads = {n: getattr(acc.unwrap_model(model), n).grad.contiguous() for n in NAMES}
save_file(grads, f"{out_dir}/grads{r}.safetensors")
