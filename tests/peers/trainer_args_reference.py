"""Reference for accel-train's TrainingArguments and schedules (tests/trainer_args.rs).

    python trainer_args_reference.py fields
        One JSON line: [[name, default], ...] of dataclasses.fields(transformers.TrainingArguments),
        enum defaults by their value.

    python trainer_args_reference.py schedules SPEC_JSON
        SPEC_JSON: {"lr": L, "total": T, "warmup": W, "cases": [[type, kwargs], ...]}. For each case,
        transformers' get_scheduler(type, SGD(lr=L), W, T, scheduler_specific_kwargs=kwargs) and the
        learning rate after 0..T+2 steps; one JSON line: [[lr, ...], ...].
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


if __name__ == "__main__":
    if sys.argv[1] == "fields":
        fields()
    else:
        schedules(json.loads(sys.argv[2]))
