"""How PyTorch's DDP buckets a model's gradients: the peer of accel-ddp's buckets.

    ddp_buckets.py mlp --in 16 --hidden H --out 4 [--layers L] --batch-size N [--bucket-cap-mb X]
    ddp_buckets.py gpt2 --model DIR --block-size B --batch-size N [--bucket-cap-mb X]

Wraps the model (accel's mlp example as a torch module with its parameter
names, or transformers' GPT2LMHeadModel from DIR with its default attention,
sdpa, as accel's gpt2) in torch.nn.parallel.DistributedDataParallel (one gloo
process: the Reducer's buckets do not depend on the world size), runs two
training steps on random data, and prints one JSON line: {"rebuilt": [[name,
...], ...]}, the buckets the Reducer rebuilt after the first step in the order
gradients came (`_get_ddp_logging_data()["rebuilt_per_bucket_param_indices"]`,
indices into the trainable parameters, turned into names). Without
--bucket-cap-mb DDP gets no bucket_cap_mb, as Accelerate passes none by
default.
"""
import argparse
import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F


class Mlp(torch.nn.Module):
    """accel's drivers/mlp.rs: l1, l2, layers.i, l3, ReLU between."""

    def __init__(self, d, hidden, o, layers):
        super().__init__()
        self.l1 = torch.nn.Linear(d, hidden)
        self.l2 = torch.nn.Linear(hidden, hidden)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(layers))
        self.l3 = torch.nn.Linear(hidden, o)

    def forward(self, x):
        h = self.l2(self.l1(x).relu()).relu()
        for layer in self.layers:
            h = layer(h).relu()
        return self.l3(h)


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="model", required=True)
    mlp = sub.add_parser("mlp")
    mlp.add_argument("--in", dest="d", type=int, default=16)
    mlp.add_argument("--hidden", type=int, required=True)
    mlp.add_argument("--out", type=int, default=4)
    mlp.add_argument("--layers", type=int, default=0)
    gpt2 = sub.add_parser("gpt2")
    gpt2.add_argument("--model", dest="path", required=True)
    gpt2.add_argument("--block-size", type=int, required=True)
    for p in (mlp, gpt2):
        p.add_argument("--batch-size", type=int, required=True)
        p.add_argument("--bucket-cap-mb", type=float)
    args = ap.parse_args()

    torch.manual_seed(0)
    if args.model == "mlp":
        model = Mlp(args.d, args.hidden, args.out, args.layers)

        def loss():
            x, y = torch.randn(args.batch_size, args.d), torch.randn(args.batch_size, args.out)
            return F.mse_loss(ddp(x), y)

    else:
        from transformers import GPT2LMHeadModel

        model = GPT2LMHeadModel.from_pretrained(args.path)
        model.train()
        vocab = model.config.vocab_size

        def loss():
            ids = torch.randint(vocab, (args.batch_size, args.block_size + 1))
            logits = ddp(input_ids=ids[:, :-1]).logits
            return F.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "store"), rank=0, world_size=1)
        kwargs = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
        ddp = torch.nn.parallel.DistributedDataParallel(model, **kwargs)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        # The rebuild happens in the second step's forward; the logging data
        # shows it from the third.
        for _ in range(3):
            opt.zero_grad()
            loss().backward()
            opt.step()
        data = ddp._get_ddp_logging_data()
        dist.destroy_process_group()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    rebuilt = [
        [names[int(i)] for i in bucket.split()]
        for bucket in data["rebuilt_per_bucket_param_indices"].split(",")
    ]
    print(json.dumps({"rebuilt": rebuilt}))


if __name__ == "__main__":
    main()
