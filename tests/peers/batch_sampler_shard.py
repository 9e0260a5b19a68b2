"""Reference: the batches Accelerate's BatchSamplerShard gives each rank.

Input (argv[1]): JSON list of cases [n, batch_size, num_processes, split_batches, even_batches, drop_last].
Output: JSON list, per case, per rank, the list of batches (lists of indices).
"""
import json
import sys

from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler

out = []
for n, bs, nproc, split, even, drop in json.loads(sys.argv[1]):
    ranks = []
    for r in range(nproc):
        sampler = BatchSampler(range(n), batch_size=bs, drop_last=drop)
        shard = BatchSamplerShard(
            sampler, num_processes=nproc, process_index=r, split_batches=split, even_batches=even
        )
        ranks.append([list(b) for b in shard])
    out.append(ranks)
print(json.dumps(out))
