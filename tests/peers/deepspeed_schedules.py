"""DeepSpeed's own learning-rate schedules, stepped as its engine steps them.

Usage: deepspeed_schedules.py CASES.json OUT.json

CASES.json is a list of {"scheduler": a DeepSpeed `scheduler` section,
"lr": the optimizer's rate, "steps": N}. Each schedule is built as
DeepSpeedEngine._scheduler_from_config builds it (`getattr(lr_schedules,
type)(optimizer, **params)`) over a torch.optim.SGD with rate `lr`; OUT.json
gets, per case, the rate when it is made and after each of N `step()`s.
"""

import json
import sys

import torch
from deepspeed.runtime import lr_schedules


def rates(case):
    section = case["scheduler"]
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=case["lr"])
    scheduler = getattr(lr_schedules, section["type"])(optimizer, **section.get("params", {}))
    out = [optimizer.param_groups[0]["lr"]]
    for _ in range(case["steps"]):
        scheduler.step()
        out.append(optimizer.param_groups[0]["lr"])
    return out


def main():
    cases_path, out_path = sys.argv[1:]
    with open(cases_path) as f:
        cases = json.load(f)
    with open(out_path, "w") as f:
        json.dump([rates(c) for c in cases], f)


if __name__ == "__main__":
    main()
