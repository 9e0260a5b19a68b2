"""Reference: which sample indices each rank sees, per step, from a DataLoader prepared by real Accelerate.

Run (CPU, gloo; N = 1, 2 or 3; all cases run in this one launch):

    .venv/bin/torchrun --nproc_per_node N --master_port P tests/peers/loader_order.py SPEC.json OUT_DIR

SPEC.json is a JSON list of cases:
    {"name": str, "kind": "map" | "iterable", "n": int, "batch_size": int, "epochs": int,
     "shuffle": bool, "data_seed": int, "drop_last": bool, "even_batches": bool,
     "split_batches": bool, "dispatch_batches": bool | null}
"map" is a map-style Dataset whose item i is torch.tensor(i); "iterable" is an IterableDataset
yielding torch.tensor(0) .. torch.tensor(n - 1) in order (shuffle must be false: torch rejects it).

Each case gets a fresh Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
split_batches, even_batches, dispatch_batches, use_seedable_sampler=True, data_seed)), with the
Accelerate singletons reset in between. Every rank writes OUT_DIR/rank{R}.json:
    {case name: {"epochs": [[{"indices": [...], "end": bool, "remainder": int,
                              "gathered": [...] | null}, ... per batch], ... per epoch]}
                | {"error": "<ExceptionClass>: <message>"}}
"end" / "remainder" are accelerator.gradient_state.end_of_dataloader / .remainder read right after the
batch is yielded; "gathered" is accelerator.gather_for_metrics(batch).tolist().

gather_for_metrics is a collective: with even_batches=False the ranks can have a different number of
batches or different batch lengths at a step, where real Accelerate would hang or fail. So before each
gather the ranks exchange (has batch, batch length) with an extra all_gather_object, and "gathered" is
null at the steps where not every rank has a batch of the same length; there gather_for_metrics is not
called. A rank that runs out of batches keeps answering that exchange until every rank is done.
"""
import json
import os
import sys
import warnings

os.environ.setdefault("ACCELERATE_USE_CPU", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # keeps Accelerate from warning that it sets it
warnings.filterwarnings("ignore")

from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from accelerate import Accelerator, DataLoaderConfiguration  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import InitProcessGroupKwargs  # noqa: E402
from gloo_exit import leave  # noqa: E402
from torch.utils.data import DataLoader, Dataset, IterableDataset  # noqa: E402


class RangeMap(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor(i)


class RangeIter(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield torch.tensor(i)


def exchange(item):
    """all_gather_object of one small object; a no-op list when not distributed."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [item]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, item)
    return out


def reset_state():
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def run_case(case):
    config = DataLoaderConfiguration(
        split_batches=case["split_batches"],
        even_batches=case["even_batches"],
        dispatch_batches=case["dispatch_batches"],
        use_seedable_sampler=True,
        data_seed=case["data_seed"],
    )
    # The timeout only applies to the launch's first Accelerator (the one that creates the process group).
    acc = Accelerator(
        cpu=True,
        dataloader_config=config,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=120))],
    )
    n, bs, drop = case["n"], case["batch_size"], case["drop_last"]
    if case["kind"] == "map":
        dl = DataLoader(RangeMap(n), batch_size=bs, shuffle=case["shuffle"], drop_last=drop)
    elif case["kind"] == "iterable":
        # shuffle=True is passed through so that torch raises its own error for it.
        dl = DataLoader(RangeIter(n), batch_size=bs, shuffle=case.get("shuffle") or None, drop_last=drop)
    else:
        raise ValueError(f"unknown kind {case['kind']!r}")
    dl = acc.prepare(dl)
    epochs = []
    for _ in range(case["epochs"]):
        steps = []
        for batch in dl:
            gs = acc.gradient_state
            step = {
                "indices": batch.tolist(),
                "end": bool(gs.end_of_dataloader),
                "remainder": int(gs.remainder),
            }
            peers = exchange(len(step["indices"]))
            if all(p is not None for p in peers) and len(set(peers)) == 1:
                step["gathered"] = acc.gather_for_metrics(batch).tolist()
            else:
                step["gathered"] = None
            steps.append(step)
        # This rank is out of batches: answer the others' exchanges until every rank is.
        while not all(p is None for p in exchange(None)):
            pass
        epochs.append(steps)
    return {"epochs": epochs}


def main():
    spec_path, out_dir = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        cases = json.load(f)
    results = {}
    for case in cases:
        try:
            results[case["name"]] = run_case(case)
        except Exception as e:  # noqa: BLE001 - recorded per case, by design
            results[case["name"]] = {"error": f"{type(e).__name__}: {e}"}
        reset_state()
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
    else:
        rank = int(os.environ.get("RANK", "0"))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=None, separators=(",", ":"))
        f.write("\n")
    if dist.is_available() and dist.is_initialized():
        leave(dist.barrier)


if __name__ == "__main__":
    main()
