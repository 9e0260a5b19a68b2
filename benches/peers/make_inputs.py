"""Data and initial weights shared by accel's mlp and the Accelerate peer.

Usage: make_inputs.py DIR HIDDEN SAMPLES
Writes DIR/data.safetensors (x [N,16], y [N,4]) and DIR/init.safetensors
(l1.weight ... l3.bias, torch.nn.Linear's initialisation).
"""
import sys

import torch
from safetensors.torch import save_file

out, hidden, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
x = torch.randn(n, 16)
w = torch.randn(16, 4)
y = torch.tanh(x @ w) + 0.5 * x[:, :4]
save_file({"x": x, "y": y.contiguous()}, f"{out}/data.safetensors")
layers = {"l1": torch.nn.Linear(16, hidden), "l2": torch.nn.Linear(hidden, hidden), "l3": torch.nn.Linear(hidden, 4)}
save_file({f"{k}.{p}": t.detach().contiguous() for k, m in layers.items() for p, t in m.named_parameters()},
          f"{out}/init.safetensors")
