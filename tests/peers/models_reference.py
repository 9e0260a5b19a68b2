"""Reference for accel-models: transformers' own causal language models.

Subcommands:

    init DIR --config JSON [--seed S] [--dtype float32|bfloat16|float16] [--max-shard-size SIZE]
        torch.manual_seed(S); AutoModelForCausalLM.from_config(AutoConfig.for_model(**JSON)) saved with
        save_pretrained(DIR, max_shard_size=SIZE) in DTYPE. JSON holds model_type and the config's keys.

    logits DIR OUT --ids "1,2,3;4,5" [--attn-implementation sdpa|eager] [--dtype float32]
        AutoModelForCausalLM.from_pretrained(DIR) in eval mode on the prompts (';' between rows), left-padded
        with 0 and an attention_mask when their lengths differ, position_ids as generate computes them
        (cumsum of the mask - 1, 0 on padding); writes safetensors {input_ids, attention_mask, logits}.

    generate DIR --ids "1,2,3;4,5" [--max-new-tokens N] [--do-sample] [--temperature T] [--top-k K]
             [--top-p P] [--repetition-penalty R] [--seed S] [--no-cache]
        transformers.set_seed(S); the left-padded batch through model.generate(input_ids, attention_mask,
        max_new_tokens=N, ...); prints one JSON line: {"new": [[ids after each prompt], ...], "seconds":
        the generate call's} (each row up to and including its first eos id).

    tokenizer DIR [--vocab-size 400]
        A byte-level BPE trained by Python's tokenizers on a few English sentences, its first token
        `<|endoftext|>`, written to DIR/tokenizer.json.

    generate DIR --prompt TEXT [--prompt TEXT ...] [the options above]
        The prompts tokenized by DIR/tokenizer.json (tokenizers' encode, special tokens added) instead
        of --ids; the JSON line also holds "text": each row's new tokens decoded with
        skip_special_tokens.

    batch
        Each line of stdin is a JSON list: the arguments of one of the commands above, run in turn in this
        one process (Python and transformers start once).
"""
import argparse
import json
import os
import sys
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def batch(text, pad=0):
    rows = [[int(t) for t in r.split(",")] for r in text.split(";")]
    longest = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (longest - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (longest - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def cmd_init(a):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(a.seed)
    spec = json.loads(a.config)
    config = AutoConfig.for_model(**spec)
    model = AutoModelForCausalLM.from_config(config)
    model.to(DTYPES[a.dtype]).save_pretrained(a.dir, max_shard_size=a.max_shard_size)


def load(a):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        a.dir, dtype=DTYPES[a.dtype], attn_implementation=a.attn_implementation
    )
    return model.eval()


def cmd_logits(a):
    model = load(a)
    ids, mask = batch(a.ids)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    save_file(
        {"input_ids": ids, "attention_mask": mask, "logits": logits.float().contiguous()}, a.out
    )


def cmd_tokenizer(a):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = ["the cat sat on the mat", "a dog ran to the park", "accel trains models"] * 30
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=a.vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer)
    os.makedirs(a.dir, exist_ok=True)
    tok.save(os.path.join(a.dir, "tokenizer.json"))


def cmd_generate(a):
    import transformers

    model = load(a)
    tokenizer = None
    if a.prompt:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(os.path.join(a.dir, "tokenizer.json"))
        a.ids = ";".join(",".join(map(str, tokenizer.encode(p).ids)) for p in a.prompt)
    pad = model.generation_config.pad_token_id
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else (eos if isinstance(eos, list) else [eos])
    if pad is None:
        pad = eos[0] if eos else 0
    ids, mask = batch(a.ids, pad)
    transformers.set_seed(a.seed)
    kwargs = dict(max_new_tokens=a.max_new_tokens, do_sample=a.do_sample, pad_token_id=pad,
                  use_cache=not a.no_cache, repetition_penalty=a.repetition_penalty)
    if a.do_sample:
        kwargs.update(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p)
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, **kwargs)
    seconds = time.perf_counter() - started
    new = []
    for row in out[:, ids.shape[1]:].tolist():
        cut = next((i for i, t in enumerate(row) if t in eos), None)
        new.append(row if cut is None else row[: cut + 1])
    result = {"new": new, "seconds": seconds}
    if tokenizer is not None:
        result["text"] = [tokenizer.decode(row, skip_special_tokens=True) for row in new]
    print(json.dumps(result))


def parser():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("init")
    i.add_argument("dir")
    i.add_argument("--config", required=True)
    i.add_argument("--seed", type=int, default=0)
    i.add_argument("--dtype", default="float32", choices=list(DTYPES))
    i.add_argument("--max-shard-size", default="50GB")
    for name in ("logits", "generate"):
        s = sub.add_parser(name)
        s.add_argument("dir")
        if name == "logits":
            s.add_argument("out")
        s.add_argument("--ids", required=(name == "logits"))
        s.add_argument("--dtype", default="float32", choices=list(DTYPES))
        s.add_argument("--attn-implementation", default="sdpa", choices=["sdpa", "eager"])
    g = sub.choices["generate"]
    g.add_argument("--max-new-tokens", type=int, default=20)
    g.add_argument("--do-sample", action="store_true")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-cache", action="store_true")
    g.add_argument("--prompt", action="append", default=[])
    t = sub.add_parser("tokenizer")
    t.add_argument("dir")
    t.add_argument("--vocab-size", type=int, default=400)
    sub.add_parser("batch")
    return p


def main(argv):
    a = parser().parse_args(argv)
    if a.cmd == "batch":
        for line in sys.stdin:
            if line.strip():
                main(json.loads(line))
        return
    commands = {"init": cmd_init, "logits": cmd_logits, "generate": cmd_generate, "tokenizer": cmd_tokenizer}
    commands[a.cmd](a)
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
