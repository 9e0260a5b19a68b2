"""Reference for accel-train's TrainingArguments and schedules (tests/trainer_args.rs).

    python trainer_args_reference.py fields
        One JSON line: [[name, default], ...] of dataclasses.fields(transformers.TrainingArguments),
        enum defaults by their value.

    python trainer_args_reference.py schedules SPEC_JSON
        SPEC_JSON: {"lr": L, "total": T, "warmup": W, "cases": [[type, kwargs], ...]}. For each case,
        transformers' get_scheduler(type, SGD(lr=L), W, T, scheduler_specific_kwargs=kwargs) and the
        learning rate after 0..T+2 steps; one JSON line: [[lr, ...], ...].

    python trainer_args_reference.py adafactor IN OUT SPEC_JSON
        SPEC_JSON: {"lr": L, "weight_decay": WD, "steps": S}. IN holds parameters p.<i> and their
        gradients g.<step>.<i>; transformers' Adafactor as the Trainer's `optim adafactor` builds it
        (lr=L, scale_parameter=False, relative_step=False) over two groups (even i with weight decay
        WD, odd i without) takes S steps; OUT gets the parameters p.<i> and the state p.<i>.<slot>.
"""
import dataclasses
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")


def fields():
    import transformers
    out = []
    for f in dataclasses.fields(transformers.TrainingArguments):
        if f.default is not dataclasses.MISSING:
            d = f.default
        elif f.default_factory is not dataclasses.MISSING:
            d = f.default_factory()
        else:
            d = None
        d = getattr(d, "value", d)
        out.append([f.name, d])
    print(json.dumps(out))


def schedules(spec):
    import torch
    from transformers import get_scheduler
    rows = []
    for kind, kwargs in spec["cases"]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=spec["lr"])
        s = get_scheduler(kind, opt, num_warmup_steps=spec["warmup"], num_training_steps=spec["total"],
                          scheduler_specific_kwargs=kwargs)
        lrs = []
        for _ in range(spec["total"] + 3):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            s.step()
        rows.append(lrs)
    print(json.dumps(rows))


def adafactor(src, dst, spec):
    import torch
    from safetensors.torch import load_file, save_file
    from transformers.optimization import Adafactor
    t = load_file(src)
    n = len([k for k in t if k.startswith("p.")])
    params = [torch.nn.Parameter(t[f"p.{i}"].clone()) for i in range(n)]
    groups = [{"params": params[0::2], "weight_decay": spec["weight_decay"]},
              {"params": params[1::2], "weight_decay": 0.0}]
    opt = Adafactor(groups, lr=spec["lr"], scale_parameter=False, relative_step=False)
    for step in range(spec["steps"]):
        for i, p in enumerate(params):
            p.grad = t[f"g.{step}.{i}"].clone()
        opt.step()
    out = {}
    for i, p in enumerate(params):
        out[f"p.{i}"] = p.detach().contiguous()
        for slot, v in opt.state[p].items():
            if torch.is_tensor(v) and slot != "RMS":
                out[f"p.{i}.{slot}"] = v.contiguous()
    save_file(out, dst)


if __name__ == "__main__":
    if sys.argv[1] == "fields":
        fields()
    elif sys.argv[1] == "adafactor":
        adafactor(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))
    else:
        schedules(json.loads(sys.argv[2]))
