"""Reference for `accel train`: transformers' Trainer driven the way examples/pytorch/language-modeling/run_clm.py
drives it, without `datasets`.

    python run_clm_reference.py --model_name_or_path DIR --train_file a.txt [--validation_file b.txt]
        [--block_size N] [any TrainingArguments flag, e.g. --output_dir out --report_to none --use_cpu ...]

Under `torchrun --nproc_per_node 2` it runs on 2 CPU ranks (gloo), e.g. with OMP_NUM_THREADS=1.

Data, exactly as run_clm.py with its defaults (keep_linebreaks=True, `datasets.map(batched=True)` batches of
1000 examples, no --max_train_samples):
  * a file is read as text (UTF-8, universal newlines: "\r\n" and "\r" become "\n") and split like
    `datasets`' "text" loader: io.StringIO(text).readlines(), i.e. split after every "\n", keeping it. Every
    line is one example, an empty line too (it is the string "\n"); a final line without "\n" is kept as is,
    a file ending in "\n" has no extra empty example after it.
  * each example is tokenized with tokenizer(lines) (the tokenizer's __call__, add_special_tokens default);
    only input_ids and attention_mask are kept (run_clm's Trainer drops other columns the model's forward
    does not name).
  * group_texts per run of 1000 consecutive examples (map's batch_size): concatenate them, cut into blocks of
    block_size tokens, drop that run's remainder; labels = input_ids (copy). With <= 1000 lines this is
    "concatenate everything, drop the tail".
  * block_size: --block_size capped at tokenizer.model_max_length; without it tokenizer.model_max_length,
    or min(1024, max_position_embeddings) when that exceeds the model's max_position_embeddings (run_clm).
  * no --validation_file: no evaluation (run_clm would split off 5% of the train file instead).

Then Trainer(model, args, train_dataset, eval_dataset, data_collator=default_data_collator):
trainer.train(resume_from_checkpoint=args.resume_from_checkpoint) (the string "True"/"true" means True: the
last checkpoint-N of output_dir, Trainer's get_last_checkpoint), save_model(), metrics
train_samples = len(train); log/save_metrics("train"), save_state(); evaluate(), eval_samples,
perplexity = exp(eval_loss) (inf on overflow); log/save_metrics("eval"). save_metrics writes
OUTPUT_DIR/train_results.json, eval_results.json and merges each into all_results.json (main process only).
The model is AutoModelForCausalLM.from_pretrained(DIR, dtype=torch.float32). Unlike run_clm: no processing_class
(run_clm passes the tokenizer, whose files then also land in each checkpoint) and no compute_metrics (run_clm
adds eval_accuracy); training and eval_loss are the same either way. Under torchrun every rank meets at a
barrier at the end and leaves with os._exit(0) (gloo_exit.leave: gloo's teardown sometimes aborts).
"""
import io
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
class ScriptArgs:
    model_name_or_path: str
    train_file: str | None = None
    validation_file: str | None = None
    block_size: int | None = None


class Blocks(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        ids = torch.tensor(self.rows[i], dtype=torch.long)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def load_blocks(path, tokenizer, block_size, map_batch=1000):
    with open(path, encoding="utf-8") as f:
        lines = io.StringIO(f.read()).readlines()
    ids = tokenizer(lines)["input_ids"] if lines else []
    rows = []
    for start in range(0, len(ids), map_batch):
        concat = [t for enc in ids[start:start + map_batch] for t in enc]
        n = len(concat) // block_size * block_size
        rows.extend(concat[i:i + block_size] for i in range(0, n, block_size))
    return Blocks(rows)


def main():
    script, args = HfArgumentParser((ScriptArgs, TrainingArguments)).parse_args_into_dataclasses()
    tokenizer = AutoTokenizer.from_pretrained(script.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(script.model_name_or_path, dtype=torch.float32)
    mml, max_pos = tokenizer.model_max_length, model.config.max_position_embeddings
    block = min(script.block_size, mml) if script.block_size else (mml if mml <= max_pos else min(1024, max_pos))
    train = load_blocks(script.train_file, tokenizer, block) if script.train_file else None
    valid = load_blocks(script.validation_file, tokenizer, block) if script.validation_file else None
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=valid,
                      data_collator=default_data_collator)
    if train is not None:
        resume = args.resume_from_checkpoint
        resume = True if resume in ("True", "true") else resume
        result = trainer.train(resume_from_checkpoint=resume)
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
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from gloo_exit import leave
        leave(torch.distributed.barrier)


if __name__ == "__main__":
    sys.exit(main())
