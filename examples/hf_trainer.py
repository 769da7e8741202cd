# A Hugging Face Trainer script with zerofn's ZeRO-2: the one change is the Trainer's class.
#
#   torchrun --standalone --nproc-per-node=2 examples/hf_trainer.py
#
# On CPUs the ranks talk over gloo, on GPUs (one process per GPU) over NCCL. The model is
# built from a config and the dataset is random tokens, so nothing is downloaded: put your
# own model, tokenizer and dataset in their place. docs/hf.md is this file.
import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from zerofn.hf import ZeroTrainer  # was: from transformers import Trainer

torch.manual_seed(0)  # the same weights on every rank (zerofn broadcasts rank 0's anyway, as DDP does)
config = GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(config)
tokens = torch.randint(0, 64, (64, 8), generator=torch.Generator().manual_seed(1))
dataset = [{"input_ids": row, "labels": row} for row in tokens]  # a causal LM: labels are the inputs

args = TrainingArguments(
    output_dir="hf-run",
    max_steps=4,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,  # the first micro-batch of each step communicates nothing
    learning_rate=1e-3,
    max_grad_norm=1.0,  # clipped by the global norm over every rank's shards, and logged
    save_steps=2,  # checkpoint-2/, checkpoint-4/: the Trainer's files and every rank's shards
    logging_steps=1,
    report_to=[],
    use_cpu=not torch.cuda.is_available(),
)
trainer = ZeroTrainer(model=model, args=args, train_dataset=dataset)  # was: Trainer(...); stage=1 for ZeRO-1
trainer.train()
trainer.train(resume_from_checkpoint="hf-run/checkpoint-2")  # at this world size or another one
trainer.accelerator.wait_for_everyone()  # every rank leaves once rank 0 wrote its last files (trainer_state.json)
