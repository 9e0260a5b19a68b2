"""Reference: Accelerate's join_uneven_inputs, run under torchrun (gloo).

The same training as tests/fixtures/join_probe.rs: a linear model, plain
SGD, 9 samples in batches of 2 with even_batches=False. Writes
rank<RANK>.json into argv[1].

Accelerate's `join_uneven_inputs` joins only on GPUs (on CPU it warns and
does nothing, and the uneven ranks hang); on GPUs it is PyTorch's `Join`
over the prepared DDP model with `throw_on_early_termination=False`, which
this script runs as such, on CPU, where gloo supports it.
"""
import json
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from gloo_exit import leave
from torch.distributed.algorithms.join import Join
from torch.utils.data import DataLoader, TensorDataset

acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(even_batches=False))
x = torch.arange(27, dtype=torch.float32).reshape(9, 3) / 10.0
y = x.sum(1, keepdim=True) * 0.5 - 1.0
model = torch.nn.Linear(3, 1)
with torch.no_grad():
    model.weight.copy_(torch.tensor([[0.1, -0.2, 0.3]]))
    model.bias.copy_(torch.tensor([0.05]))
model, loader = acc.prepare(model, DataLoader(TensorDataset(x, y), batch_size=2))
batches = 0
with Join([model], enable=True, throw_on_early_termination=False):
    for xb, yb in loader:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        acc.backward(loss)
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad.zero_()
        batches += 1
inner = acc.unwrap_model(model)
out = {
    "batches": batches,
    "weight": inner.weight.detach().flatten().double().tolist(),
    "bias": inner.bias.detach().flatten().double().tolist(),
}
with open(os.path.join(sys.argv[1], f"rank{acc.process_index}.json"), "w") as f:
    json.dump(out, f)
leave(acc.wait_for_everyone)
