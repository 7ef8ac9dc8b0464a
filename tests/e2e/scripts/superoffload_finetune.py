#!/usr/bin/env python3
"""DeepSpeedExamples' `training/DeepSpeed-SuperOffload/finetune_zero3.py`, as its users run it, on zerospeed.

The same calls in the same order as its `main()`: a HF causal LM from `from_pretrained` (an MoE model: its sparse
blocks flagged with `set_z3_leaf_modules(model, [args.leaf_module])`, by class name), gradient checkpointing
(`use_reentrant=False`), a client `DeepSpeedCPUAdam(model.parameters(), lr, betas)`, `initialize(args=...,
model=..., optimizer=..., training_data=..., collate_fn=default_data_collator)` with the example's ZeRO-3
SuperOffload config (from `--deepspeed_config`), its parameter count `p.ds_numel if hasattr(p, "ds_tensor") else
p.numel()`, and the epoch loop over the returned loader. Only the import lines name zerospeed. Changed for this
machine: the model is a local directory and the alpaca dataset (a download) is replaced by random token
sequences of `--max_length` (the example's tokenised rows: input_ids, attention_mask, labels); no wandb, no
timing/TFLOPs report. `--out` (added) writes the rank's per-step losses, the parameter count and the number of
leaf modules flagged as JSON.
"""
import argparse
import json
import os

import torch
from transformers import AutoModelForCausalLM, default_data_collator

import zerospeed as deepspeed
from zerospeed import comm as dist

DEFAULT_OPTIMIZER_BETAS = (0.9, 0.999)


def get_parameter_count(parameter: torch.nn.Parameter) -> int:
    return parameter.ds_numel if hasattr(parameter, "ds_tensor") else parameter.numel()


def setup_model_training(model, use_activation_checkpointing=True):
    if use_activation_checkpointing:
        if hasattr(model.config, 'use_cache'):
            model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def create_optimizer(model, lr):
    from zerospeed.ops.adam import DeepSpeedCPUAdam
    return DeepSpeedCPUAdam(model.parameters(), lr=lr, betas=DEFAULT_OPTIMIZER_BETAS)


def load_dataset(rows, max_length, vocab, seed=7):
    g = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(rows):
        ids = torch.randint(0, vocab, (max_length,), generator=g)
        data.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return data


def main(args):
    model = AutoModelForCausalLM.from_pretrained(args.model_name, dtype=torch.float32, attn_implementation="eager")
    if args.leaf_module:
        from zerospeed.utils import set_z3_leaf_modules
        set_z3_leaf_modules(model, [args.leaf_module])
    setup_model_training(model, args.activation_checkpointing)
    optimizer = create_optimizer(model, args.lr)
    tokenized_dataset = load_dataset(args.rows, args.max_length, model.config.vocab_size)
    model_engine, optimizer, train_dataloader, _ = deepspeed.initialize(
        args=args, model=model, optimizer=optimizer, training_data=tokenized_dataset,
        collate_fn=default_data_collator)
    model_engine.train()
    model_size = sum(get_parameter_count(p) for p in model.parameters())
    losses = []
    for epoch in range(args.num_train_epochs):
        for step, batch in enumerate(train_dataloader):
            batch = {k: v.to(model_engine.device) for k, v in batch.items()}
            outputs = model_engine(**batch)
            loss = outputs.loss
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
    from zerospeed.utils import get_z3_leaf_modules
    with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"losses": losses, "model_size": model_size, "leaf_modules": len(get_z3_leaf_modules(model))}, f)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name", type=str, required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--leaf_module", type=str, default=None)
    parser.add_argument("--activation_checkpointing", action="store_true")
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--max_length", type=int, default=16)
    parser.add_argument("--rows", type=int, default=12)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", type=str, required=True)
    parser = deepspeed.add_config_arguments(parser)
    main(parser.parse_args())
