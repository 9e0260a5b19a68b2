"""Reference for accel's clm example: transformers' causal LMs (AutoModelForCausalLM: GPT-2, Llama,
Mistral, Qwen2) trained with Accelerate.

Subcommands:

    init DIR --n-layer L --n-embd E --n-head H --vocab-size V --n-positions P --seed S [--dropout 0]
        torch.manual_seed(S); GPT2LMHeadModel(GPT2Config(...)).save_pretrained(DIR)

    train --model DIR --data FILE [--token-dtype u16|u32] --block-size B --batch-size N --steps K
          [--epochs E] [--lr 6e-4] [--weight-decay 0.01] [--scheduler constant|linear|cosine] [--warmup W]
          [--data-seed S] [--grad-accum G] [--max-grad-norm M] [--freeze REGEX ...]
          [--loss-log FILE] [--save DIR] [--fsdp] [--comm-hook no|fp16|bf16|power_sgd] [--comm-state JSON]
          [--bucket-cap-mb X] [--attn-implementation sdpa|eager] [--peft ADAPTERS]
        The same loop as drivers/clm.rs. Run with plain python (one process) or
        `torchrun --nproc_per_node 2` (CPU, gloo; `accelerate launch --cpu` starts only one process).
        --fsdp: PyTorch's FSDP2 (`fully_shard`, FULL_SHARD) on every decoder layer (the model's
        `_no_split_modules`: GPT2Block, LlamaDecoderLayer, ...) and the root instead
        of DDP, for the benchmarks (Accelerate falls back to DDP on a CPU-only machine and FSDP1
        needs an accelerator, so torch shards the model and Accelerate prepares the rest).
        --comm-hook: DDP's communication hook, DistributedDataParallelKwargs(comm_hook=...) (PyTorch's
        fp16_compress_hook / bf16_compress_hook / powerSGD_hook), the peer of accel-ddp's `comm_hook`;
        --comm-state: its comm_state_option (PowerSGDState's options), JSON. --bucket-cap-mb: DDP's.

    logits --ids 1,2,3 [--model DIR FILE ...] [--peft BASE ADAPTERS FILE ...]
        GPT2LMHeadModel.from_pretrained(DIR) (default attention) in eval mode; writes the logits for
        the ids to FILE as safetensors {input_ids [1, T], logits [1, T, V]}. --peft: PEFT's
        PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(BASE), ADAPTERS) instead.

    generate --model DIR (--ids 1,2,3 | --prompt TEXT) [--max-new-tokens 20] [--do-sample] [--temperature 1]
             [--top-k 50] [--top-p 1] [--seed 0]
        transformers.set_seed(S); GPT2LMHeadModel.from_pretrained(DIR).generate(ids, max_new_tokens=N,
        do_sample=..., ...) (the prompt tokenized by DIR's tokenizer.json through PreTrainedTokenizerFast);
        prints one JSON line: {"ids": [...], "text": decoded (with a tokenizer)}.

    peft-init BASE DIR --r R --alpha A [--dropout P] [--seed S] [--targets a,b] [--bias none|all|lora_only]
        torch.manual_seed(S); get_peft_model(AutoModelForCausalLM.from_pretrained(BASE),
        LoraConfig(r=R, lora_alpha=A, lora_dropout=P, target_modules=TARGETS (PEFT's default for the model
        type: c_attn, or q_proj,v_proj), fan_in_fan_out=(GPT-2), bias=BIAS,
        init_lora_weights=False)).save_pretrained(DIR): adapters PEFT made, lora_B random (not zero),
        so they change the model, for accel's `--lora-from`.

Training setup, matching accel's gpt2:
* Data: the nanoGPT token file as windows k -> input_ids t[k*B : k*B+B], labels t[k*B+1 : k*B+B+1]
  (int64), DataLoader(ds, batch_size, shuffle=True) prepared by
  Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=S)).
* Model: AutoModelForCausalLM.from_pretrained(DIR, attn_implementation=A) (accel's --attn-implementation: sdpa, transformers'
  default, unless given), train() mode;
  the parity runs use dropout 0.
* Loss: F.cross_entropy(logits.view(-1, V), labels.view(-1)) (the labels are already shifted).
* Optimizer: torch.optim.AdamW(model.parameters(), lr, weight_decay) with its defaults (betas 0.9/0.999,
  eps 1e-8): one group, every parameter decayed — accel's OptimizerConfig::adamw(lr).weight_decay(wd).
  Frozen parameters (--freeze, re.search on the name) get requires_grad False and no gradient.
* Schedule: transformers' get_{constant,linear,cosine}_schedule_with_warmup over steps * num_processes
  single-process steps, stepped by Accelerate's AcceleratedScheduler.
* Log: one JSON line per optimizer step: step (from 1), loss (mean over the step's micro-batches,
  then over the ranks: accelerator.reduce(..., "mean")), lr (the rate the step used), grad_norm.
"""
import argparse
import json
import os
import re
import sys
import time
import warnings

os.environ.setdefault("ACCELERATE_USE_CPU", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402


class TokenWindows(Dataset):
    def __init__(self, path, dtype, block):
        self.t = np.memmap(path, dtype={"u16": np.uint16, "u32": np.uint32}[dtype], mode="r")
        self.block = block

    def __len__(self):
        return (len(self.t) - 1) // self.block

    def __getitem__(self, k):
        b = self.block
        w = torch.from_numpy(self.t[k * b : k * b + b + 1].astype(np.int64))
        return {"input_ids": w[:-1], "labels": w[1:]}


def cmd_init(a):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(a.seed)
    v = a.vocab_size
    config = GPT2Config(
        n_layer=a.n_layer,
        n_embd=a.n_embd,
        n_head=a.n_head,
        vocab_size=v,
        n_positions=a.n_positions,
        resid_pdrop=a.dropout,
        embd_pdrop=a.dropout,
        attn_pdrop=a.dropout,
        activation_function=a.activation_function,
        reorder_and_upcast_attn=a.reorder_and_upcast_attn,
        scale_attn_by_inverse_layer_idx=a.scale_attn_by_inverse_layer_idx,
        bos_token_id=min(v, 50257) - 1,
        eos_token_id=min(v, 50257) - 1,
    )
    GPT2LMHeadModel(config).to(getattr(torch, a.dtype)).save_pretrained(a.dir)


def cmd_logits(a):
    from transformers import GPT2LMHeadModel

    ids = torch.tensor([[int(t) for t in a.ids.split(",")]], dtype=torch.int64)
    models = [(lambda d=d: GPT2LMHeadModel.from_pretrained(d), out) for d, out in a.model]
    for base, adapters, out in a.peft:

        def load(base=base, adapters=adapters):
            from peft import PeftModel

            return PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(base), adapters)

        models.append((load, out))
    for load, out in models:
        model = load()
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float().contiguous()
        save_file({"input_ids": ids, "logits": logits}, out)


def cmd_generate(a):
    from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast, set_seed

    tok_file = os.path.join(a.model, "tokenizer.json")
    tok = PreTrainedTokenizerFast(tokenizer_file=tok_file) if os.path.exists(tok_file) else None
    if a.prompt is not None:
        ids = tok(a.prompt, return_tensors="pt").input_ids
    else:
        ids = torch.tensor([[int(t) for t in a.ids.split(",")]], dtype=torch.int64)
    model = GPT2LMHeadModel.from_pretrained(a.model)
    model.eval()
    set_seed(a.seed)
    kwargs = {"max_new_tokens": a.max_new_tokens, "do_sample": a.do_sample}
    if a.do_sample:
        kwargs.update(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)[0].tolist()
    result = {"ids": out}
    if tok is not None:
        result["text"] = tok.decode(out)
    print(json.dumps(result))


def cmd_peft_init(a):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(a.seed)
    base = AutoModelForCausalLM.from_pretrained(a.base)
    gpt2 = base.config.model_type == "gpt2"
    config = LoraConfig(
        r=a.r,
        lora_alpha=a.alpha,
        lora_dropout=a.dropout,
        target_modules=a.targets.split(",") if a.targets else (["c_attn"] if gpt2 else ["q_proj", "v_proj"]),
        fan_in_fan_out=gpt2,
        bias=a.bias,
        init_lora_weights=False,
    )
    get_peft_model(base, config).save_pretrained(a.dir)


def cmd_train(a):
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
    from transformers import (
        AutoModelForCausalLM,
        get_constant_schedule_with_warmup,
        get_cosine_schedule_with_warmup,
        get_linear_schedule_with_warmup,
    )

    acc = Accelerator(
        cpu=not a.cuda,
        mixed_precision=a.mixed_precision,
        gradient_accumulation_steps=a.grad_accum,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=a.data_seed),
        kwargs_handlers=[
            DistributedDataParallelKwargs(
                comm_hook=DDPCommunicationHookType(a.comm_hook),
                comm_state_option=json.loads(a.comm_state),
                **({} if a.bucket_cap_mb is None else {"bucket_cap_mb": a.bucket_cap_mb}),
            )
        ],
    )
    model = AutoModelForCausalLM.from_pretrained(a.model, attn_implementation=a.attn_implementation)
    if a.peft:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, a.peft, is_trainable=True)
    model.train()
    for name, p in model.named_parameters():
        if any(re.search(f, name) for f in a.freeze):
            p.requires_grad_(False)
    if a.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cuda" if a.cuda else "cpu", (acc.num_processes,))
        layers = [m for m in model.modules() if type(m).__name__ in model._no_split_modules]
        for unit in [*layers, model]:
            fully_shard(unit, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.weight_decay)
    total = a.steps * acc.num_processes
    if a.scheduler == "constant":
        sched = get_constant_schedule_with_warmup(opt, a.warmup)
    elif a.scheduler == "linear":
        sched = get_linear_schedule_with_warmup(opt, a.warmup, total)
    else:
        sched = get_cosine_schedule_with_warmup(opt, a.warmup, total)
    ds = TokenWindows(a.data, a.token_dtype, a.block_size)
    dl = DataLoader(ds, batch_size=a.batch_size, shuffle=True)
    if a.fsdp:
        opt, dl, sched = acc.prepare(opt, dl, sched)
    else:
        model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
    vocab = acc.unwrap_model(model).config.vocab_size

    log = open(a.loss_log, "w") if (a.loss_log and acc.is_main_process) else None
    step, epoch, window = 0, 0, []
    started = time.perf_counter()
    while step < a.steps and (a.epochs is None or epoch < a.epochs):
        for batch in dl:
            lr = opt.param_groups[0]["lr"]
            norm = None
            with acc.accumulate(model):
                logits = model(input_ids=batch["input_ids"]).logits
                loss = F.cross_entropy(logits.float().view(-1, vocab), batch["labels"].view(-1))
                acc.backward(loss)
                if acc.sync_gradients and a.max_grad_norm is not None:
                    norm = float(acc.clip_grad_norm_(model.parameters(), a.max_grad_norm))
                opt.step()
                sched.step()
                opt.zero_grad()
            window.append(loss.detach())
            if not acc.sync_gradients:
                continue
            step += 1
            mean = acc.reduce(torch.stack(window).mean(), "mean").item()
            window = []
            if log:
                record = {"step": step, "loss": mean, "lr": lr}
                if norm is not None:
                    record["grad_norm"] = norm
                log.write(json.dumps(record) + "\n")
            if step >= a.steps:
                break
        epoch += 1
    secs = time.perf_counter() - started
    if acc.is_main_process:
        # The same summary line as accel's gpt2, for the benchmarks.
        print(f"gpt2-reference: {step} steps, {step / max(secs, 1e-9):.3f} steps/s", flush=True)
    if log:
        log.close()
    acc.wait_for_everyone()
    if a.save and acc.is_main_process:
        acc.unwrap_model(model).save_pretrained(a.save)
    acc.wait_for_everyone()
    acc.end_training()


def main(argv):
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("init")
    i.add_argument("dir")
    i.add_argument("--n-layer", type=int, required=True)
    i.add_argument("--n-embd", type=int, required=True)
    i.add_argument("--n-head", type=int, required=True)
    i.add_argument("--vocab-size", type=int, required=True)
    i.add_argument("--n-positions", type=int, required=True)
    i.add_argument("--seed", type=int, default=0)
    i.add_argument("--dropout", type=float, default=0.0)
    i.add_argument("--activation-function", default="gelu_new")
    i.add_argument("--reorder-and-upcast-attn", action="store_true")
    i.add_argument("--scale-attn-by-inverse-layer-idx", action="store_true")
    i.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    t = sub.add_parser("train")
    t.add_argument("--model", required=True)
    t.add_argument("--data", required=True)
    t.add_argument("--token-dtype", default="u16", choices=["u16", "u32"])
    t.add_argument("--block-size", type=int, required=True)
    t.add_argument("--batch-size", type=int, required=True)
    t.add_argument("--steps", type=int, required=True)
    t.add_argument("--epochs", type=int)
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--scheduler", default="constant", choices=["constant", "linear", "cosine"])
    t.add_argument("--warmup", type=int, default=0)
    t.add_argument("--data-seed", type=int, default=0)
    t.add_argument("--grad-accum", type=int, default=1)
    t.add_argument("--max-grad-norm", type=float)
    t.add_argument("--freeze", action="append", default=[])
    t.add_argument("--loss-log")
    t.add_argument("--cuda", action="store_true", help="train on the GPU (default: CPU)")
    t.add_argument("--mixed-precision", default="no", choices=["no", "fp16", "bf16"])
    t.add_argument("--save")
    t.add_argument("--fsdp", action="store_true")
    t.add_argument("--comm-hook", default="no", choices=["no", "fp16", "bf16", "power_sgd"])
    t.add_argument("--comm-state", default="{}")
    t.add_argument("--bucket-cap-mb", type=float)
    t.add_argument("--attn-implementation", default="sdpa", choices=["sdpa", "eager"])
    t.add_argument("--peft", help="train the PEFT adapters in this directory (PeftModel, is_trainable)")
    lg = sub.add_parser("logits")
    lg.add_argument("--ids", required=True)
    lg.add_argument("--model", nargs=2, action="append", default=[], metavar=("DIR", "FILE"))
    lg.add_argument("--peft", nargs=3, action="append", default=[], metavar=("BASE", "ADAPTERS", "FILE"))
    ge = sub.add_parser("generate")
    ge.add_argument("--model", required=True)
    ge.add_argument("--ids")
    ge.add_argument("--prompt")
    ge.add_argument("--max-new-tokens", type=int, default=20)
    ge.add_argument("--do-sample", action="store_true")
    ge.add_argument("--temperature", type=float, default=1.0)
    ge.add_argument("--top-k", type=int, default=50)
    ge.add_argument("--top-p", type=float, default=1.0)
    ge.add_argument("--seed", type=int, default=0)
    pi = sub.add_parser("peft-init")
    pi.add_argument("base")
    pi.add_argument("dir")
    pi.add_argument("--r", type=int, required=True)
    pi.add_argument("--alpha", type=float, required=True)
    pi.add_argument("--dropout", type=float, default=0.0)
    pi.add_argument("--seed", type=int, default=0)
    pi.add_argument("--targets", default="")
    pi.add_argument("--bias", default="none", choices=["none", "all", "lora_only"])
    a = p.parse_args(argv)
    {
        "init": cmd_init,
        "train": cmd_train,
        "logits": cmd_logits,
        "generate": cmd_generate,
        "peft-init": cmd_peft_init,
    }[a.cmd](a)


if __name__ == "__main__":
    main(sys.argv[1:])
