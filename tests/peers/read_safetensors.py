"""Reads safetensors files with Python's `safetensors` and prints, as JSON,
every tensor's file, dtype, shape and values (flattened), plus the index
of a sharded checkpoint when there is one.

Usage: read_safetensors.py DIR
"""
import json
import os
import sys

from safetensors import safe_open

d = sys.argv[1]
out = {"tensors": {}, "index": None}
index_path = os.path.join(d, "model.safetensors.index.json")
if os.path.exists(index_path):
    out["index"] = json.load(open(index_path))
for name in sorted(os.listdir(d)):
    if not name.endswith(".safetensors"):
        continue
    with safe_open(os.path.join(d, name), framework="pt") as f:
        for key in f.keys():
            t = f.get_tensor(key)
            out["tensors"][key] = {
                "file": name,
                "dtype": str(t.dtype),
                "shape": list(t.shape),
                "values": t.flatten().tolist(),
            }
print(json.dumps(out))
