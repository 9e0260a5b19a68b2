"""Reference: right-padding of ragged sequences with torch.nn.utils.rnn.pad_sequence.

Run: .venv/bin/python tests/peers/pad_reference.py INPUT.json
INPUT.json: {"pad_value": number, "sequences": [[ints], [ints], ...]}
Prints JSON {"padded": pad_sequence(..., batch_first=True, padding_value=pad_value).tolist(),
             "attention_mask": [[1] * len(s) + [0] * (max_len - len(s)), ...]} to stdout.
"""
import json
import sys

import torch
from torch.nn.utils.rnn import pad_sequence

with open(sys.argv[1]) as f:
    spec = json.load(f)
seqs = spec["sequences"]
max_len = max((len(s) for s in seqs), default=0)
padded = pad_sequence(
    [torch.tensor(s, dtype=torch.int64) for s in seqs], batch_first=True, padding_value=spec["pad_value"]
)
mask = [[1] * len(s) + [0] * (max_len - len(s)) for s in seqs]
print(json.dumps({"padded": padded.tolist(), "attention_mask": mask}))
