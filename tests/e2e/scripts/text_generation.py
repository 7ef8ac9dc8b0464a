#!/usr/bin/env python3
"""DeepSpeedExamples' `inference/huggingface/text-generation/inference-test.py` (with its `utils.DSPipeline`), as
its users run it, on zerospeed.

The same calls in the same order: `runtime.utils.see_memory_usage`, the model from `from_pretrained` or - with
`--use_meta_tensor` - built under `OnDevice(dtype=torch.float16, device="meta")` and loaded by `init_inference`
from a checkpoint json listing the repo's `.bin` files (`{"type": "BLOOM", "checkpoints": [...]}` + `base_dir`),
`init_inference(model, dtype=..., mp_size=world_size, replace_with_kernel_inject=..., max_tokens=...,
save_mp_checkpoint_path=...)`, then `model.generate` on left-padded prompts, timed with
`get_accelerator().synchronize()`. Only the import lines name zerospeed. Changed for this machine: `--model` is a
local directory (no hub download), the default dtype is float32 (fp16 has no fast CPU kernels), and the tokenizer
call is transformers 5's (`tokenizer(...)`; `batch_encode_plus` is gone). `--out` (added) writes rank 0's
generated token ids as JSON.
"""
import argparse
import io
import json
import math
import os
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import zerospeed as deepspeed
from zerospeed.accelerator import get_accelerator
from zerospeed.runtime.utils import see_memory_usage

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True, type=str, help="model_name")
parser.add_argument("--save_mp_checkpoint_path", required=False, default=None, type=str)
parser.add_argument("--batch_size", default=1, type=int, help="batch size")
parser.add_argument("--dtype", default="float32", type=str, choices=["float32", "float16", "int8", "bfloat16"])
parser.add_argument("--hf_baseline", action='store_true', help="disable DeepSpeed inference")
parser.add_argument("--use_kernel", action='store_true', help="enable kernel-injection")
parser.add_argument("--max_tokens", default=1024, type=int, help="maximum tokens used for the text-generation KV-cache")
parser.add_argument("--max_new_tokens", default=50, type=int, help="maximum new tokens to generate")
parser.add_argument("--greedy", action='store_true', help="greedy generation mode")
parser.add_argument("--use_meta_tensor", action='store_true', help="use the meta tensors to initialize model")
parser.add_argument("--local_rank", type=int, default=int(os.getenv("LOCAL_RANK", "0")), help="local rank")
parser.add_argument("--world_size", type=int, default=int(os.getenv("WORLD_SIZE", "1")), help="world_size")
parser.add_argument("--out", type=str, required=True, help="where rank 0 writes the generated token ids (JSON)")


class DSPipeline():
    def __init__(self, model_name, dtype=torch.float16, is_meta=True, device=-1):
        self.model_name = model_name
        self.dtype = dtype
        self.device = torch.device("cpu") if device < 0 else torch.device(get_accelerator().device_name(device))
        self.tokenizer = AutoTokenizer.from_pretrained(model_name, padding_side="left")
        self.tokenizer.pad_token = self.tokenizer.eos_token
        if is_meta:
            self.config = AutoConfig.from_pretrained(self.model_name)
            self.repo_root, self.checkpoints_json = self._generate_json()
            with deepspeed.OnDevice(dtype=torch.float16, device="meta"):
                self.model = AutoModelForCausalLM.from_config(self.config)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(self.model_name)
        self.model.eval()
        if self.dtype == torch.float16:
            self.model.half()

    def __call__(self, inputs=["test"], num_tokens=100, do_sample=False):
        input_list = [inputs] if isinstance(inputs, str) else inputs
        return self.generate_outputs(input_list, num_tokens=num_tokens, do_sample=do_sample)

    def _generate_json(self):
        repo_root = self.model_name
        checkpoints_json = "checkpoints.json"
        with io.open(checkpoints_json, "w", encoding="utf-8") as f:
            file_list = [str(entry).split('/')[-1] for entry in Path(repo_root).rglob("*.[bp][it][n]") if entry.is_file()]
            data = {"type": "BLOOM", "checkpoints": file_list, "version": 1.0}
            json.dump(data, f)
        return repo_root, checkpoints_json

    def generate_outputs(self, inputs=["test"], num_tokens=100, do_sample=False):
        generate_kwargs = dict(max_new_tokens=num_tokens, do_sample=do_sample)
        input_tokens = self.tokenizer(inputs, return_tensors="pt", padding=True)
        for t in input_tokens:
            if torch.is_tensor(input_tokens[t]):
                input_tokens[t] = input_tokens[t].to(self.device)
        self.model.to(self.device)
        return self.model.generate(**input_tokens, **generate_kwargs)


args = parser.parse_args()
data_type = getattr(torch, args.dtype)
if args.local_rank == 0:
    see_memory_usage("before init", True)
t0 = time.time()
pipe = DSPipeline(model_name=args.model, dtype=data_type, is_meta=args.use_meta_tensor, device=args.local_rank)
if args.local_rank == 0:
    print(f"initialization time: {(time.time()-t0) * 1000}ms")
    see_memory_usage("after init", True)
ds_kwargs = dict(base_dir=pipe.repo_root, checkpoint=pipe.checkpoints_json) if args.use_meta_tensor else dict()
if not args.hf_baseline:
    pipe.model = deepspeed.init_inference(pipe.model, dtype=data_type, mp_size=args.world_size,
                                          replace_with_kernel_inject=args.use_kernel, max_tokens=args.max_tokens,
                                          save_mp_checkpoint_path=args.save_mp_checkpoint_path, **ds_kwargs)
if args.local_rank == 0:
    see_memory_usage("after init_inference", True)

input_sentences = ["DeepSpeed is a machine learning framework", "He is working on", "He has a", "He got all",
                   "Everyone is happy and I can", "The new movie that got Oscar this year",
                   "In the far far distance from our galaxy,", "Peace is the only way"]
if args.batch_size > len(input_sentences):
    input_sentences *= math.ceil(args.batch_size / len(input_sentences))
inputs = input_sentences[:args.batch_size]

times = []
for i in range(2):  # warmup
    get_accelerator().synchronize()
    start = time.time()
    outputs = pipe(inputs, num_tokens=args.max_new_tokens, do_sample=(not args.greedy))
    get_accelerator().synchronize()
    times.append(time.time() - start)
print(f"generation time is {times[1]} sec")
if args.local_rank == 0:
    for i, o in zip(inputs, pipe.tokenizer.batch_decode(outputs, skip_special_tokens=True)):
        print(f"\nin={i}\nout={o}\n{'-'*60}")
    with open(args.out, "w") as f:
        json.dump(outputs.tolist(), f)
