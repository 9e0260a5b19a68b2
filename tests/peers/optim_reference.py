"""torch.optim reference for tests/precision.rs.

Usage: optim_reference.py CASE.json [CASE.json ...]

CASE: {"init": init.safetensors, "data": data.safetensors, "out": out.safetensors,
       "optimizer": "sgd"|"adam"|"adamw", "groups": [{"params": [...names], <hyper>}, ...],
       "fused": bool, "steps": N, "halve_lr_at": K}
Trains relu(x W1^T + b1) W2^T + b2 on batch (step % 4) of 8 rows with MSE
loss for N steps and writes the final parameters.
"""
import json
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

def run(path):
    case = json.load(open(path))
    params = {k: v.clone().requires_grad_(True) for k, v in load_file(case["init"]).items()}
    data = load_file(case["data"])
    x, y = data["x"], data["y"]

    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[case["optimizer"]]
    groups = []
    for g in case["groups"]:
        g = dict(g)
        g["params"] = [params[n] for n in g["params"]]
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    kwargs = {"fused": True} if case.get("fused") else {"foreach": False}
    opt = cls(groups, **kwargs)

    for step in range(case["steps"]):
        if step == case.get("halve_lr_at"):
            for g in opt.param_groups:
                g["lr"] = g["lr"] * 0.5
        k = step % 4
        xb, yb = x[k * 8:(k + 1) * 8], y[k * 8:(k + 1) * 8]
        opt.zero_grad()
        h = F.relu(F.linear(xb, params["w1"], params["b1"]))
        loss = F.mse_loss(F.linear(h, params["w2"], params["b2"]), yb)
        loss.backward()
        opt.step()

    save_file({k: v.detach().contiguous() for k, v in params.items()}, case["out"])


for path in sys.argv[1:]:
    run(path)
