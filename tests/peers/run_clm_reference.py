"""Reference for `accel train`: transformers' Trainer as run_clm.py drives it.

    python run_clm_reference.py --model_name_or_path DIR --train_file a.txt [--validation_file b.txt]
        [--block_size N] [any TrainingArguments flag]

Run it under `torchrun --nproc_per_node N` for N ranks (gloo on CPU). As run_clm.py with its defaults:
the text files are read by `datasets`' text loader with keep_linebreaks (every line, empty ones too, is
an example keeping its "\n"), each tokenized by AutoTokenizer.from_pretrained(DIR)'s __call__, all
concatenated and cut into blocks of block_size (the remainder dropped), labels = input_ids. Then
Trainer(model, args, train_dataset, eval_dataset, default_data_collator): train (resuming from
--resume_from_checkpoint when given), save_model, save_state, evaluate; train_results.json,
eval_results.json and all_results.json (with perplexity) as run_clm's save_metrics writes them.
"""
import math
import os
import sys
from dataclasses import dataclass

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
    default_data_collator,
)


@dataclass
class ScriptArguments:
    model_name_or_path: str
    train_file: str | None = None
    validation_file: str | None = None
    block_size: int | None = None


class Blocks(torch.utils.data.Dataset):
    def __init__(self, ids, block):
        n = len(ids) // block
        self.rows = [ids[i * block:(i + 1) * block] for i in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        ids = torch.tensor(self.rows[i], dtype=torch.long)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def blocks(path, tokenizer, block):
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines(keepends=True)
    ids = []
    for enc in tokenizer(lines)["input_ids"]:
        ids.extend(enc)
    return Blocks(ids, block)


def main():
    script, args = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses()
    tokenizer = AutoTokenizer.from_pretrained(script.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(script.model_name_or_path, dtype=torch.float32)
    block = script.block_size or min(1024, model.config.max_position_embeddings)
    train = blocks(script.train_file, tokenizer, block) if script.train_file else None
    valid = blocks(script.validation_file, tokenizer, block) if script.validation_file else None
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=valid,
                      data_collator=default_data_collator)
    if train is not None:
        result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
        trainer.save_model()
        metrics = result.metrics
        metrics["train_samples"] = len(train)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
    if valid is not None:
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(valid)
        try:
            metrics["perplexity"] = math.exp(metrics["eval_loss"])
        except OverflowError:
            metrics["perplexity"] = float("inf")
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    sys.exit(main())
