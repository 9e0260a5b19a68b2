"""Reference: Accelerate's find_executable_batch_size on the CPU.

Prints one JSON object: for each case, the batch sizes tried and the
outcome, as tests/runtime.rs runs the same cases through accel's.
A batch above LIMIT asks for 2^45 floats a sample (libtorch's CPU
allocator refuses), below it for 16.
"""
import json
import sys

import torch
from accelerate.utils import find_executable_batch_size


def case(starting, limit, fail_with=None):
    tried = []

    @find_executable_batch_size(starting_batch_size=starting)
    def train(batch_size):
        tried.append(batch_size)
        if fail_with:
            raise RuntimeError(fail_with)
        per_sample = 2**45 if batch_size > limit else 16
        return torch.zeros(batch_size, per_sample).shape[0]

    try:
        outcome = {"ok": train()}
    except RuntimeError as e:
        outcome = {"error": str(e)}
    return {"tried": tried, **outcome}


print(json.dumps({
    "fits_below_40": case(128, 40),
    "never_fits": case(5, 0),
    "not_memory": case(128, 40, fail_with="shape '[4, 3]' is invalid for input of size 10"),
}))
