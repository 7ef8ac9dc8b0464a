"""`zerospeed tp-plan`: print the tensor-parallel sharding plan of a Hugging Face model (`describe_plan`).

    $ zerospeed tp-plan --model-type llama --tp 2
    $ zerospeed tp-plan --model-type gpt2 --hf-config '{"n_layer": 2}' --tp 4
    $ zerospeed tp-plan --hf-config path/to/config.json --tp 8

The model is built from its HF config on the meta device (`with torch.device("meta")`): shapes only, no
weights allocated, no download, no process group. Needs transformers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

__all__ = ["main", "model_from_hf_config"]


def _read_config(text: str | None) -> dict:
    """--hf-config: a path to a config.json (or a directory holding one), or a JSON object. Raises ValueError."""
    if text is None:
        return {}
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return json.loads(path.read_text())
    try:
        out = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"--hf-config {text!r} is neither an existing file / directory with config.json nor a JSON "
                         "object (e.g. '{\"num_hidden_layers\": 2}')") from None
    if not isinstance(out, dict):
        raise ValueError(f"--hf-config must be a JSON object, got {type(out).__name__}")
    return out


def model_from_hf_config(model_type: str | None, overrides: dict):
    """A HF causal-LM (`AutoModelForCausalLM.from_config`) of `model_type` (or overrides["model_type"]) with
    the config's defaults updated by `overrides`, built on the meta device. Raises ValueError for a missing
    or unknown model type."""
    import torch
    import transformers

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    overrides = dict(overrides)
    model_type = model_type or overrides.get("model_type")
    overrides.pop("model_type", None)
    if not model_type:
        raise ValueError("give --model-type (e.g. llama, gpt2) or an --hf-config with a model_type field")
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **overrides)
    except ValueError as exc:
        raise ValueError(f"unknown HF model type {model_type!r}: {exc}") from None
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `zerospeed tp-plan`; returns the exit code (2 on bad arguments or a model without a plan)."""
    parser = argparse.ArgumentParser(prog="zerospeed tp-plan",
                                     description="Print which linear layers tensor parallelism shards (row / column) "
                                                 "or replicates, their full and per-rank shapes, and the totals.")
    parser.add_argument("--model-type", help="HF model type: llama, mistral, qwen2, qwen3, gpt2, or any with a "
                                             "base_model_tp_plan (default: the --hf-config's model_type)")
    parser.add_argument("--hf-config", help="a config.json path (or its directory) or a JSON object of config fields "
                                            "overriding the model type's defaults")
    parser.add_argument("--tp", type=int, required=True, help="tensor-parallel size")
    parser.add_argument("--preset-model", default=None, help="tensor_parallel.preset_model: a built-in plan by name")
    parser.add_argument("--partition-config", default=None,
                        help="tensor_parallel.partition_config as JSON ({\"layer_specs\": [...]})")
    args = parser.parse_args(argv)
    if args.tp < 1:
        parser.error(f"--tp must be >= 1, got {args.tp}")
    from .describe import describe_plan

    try:
        partition = json.loads(args.partition_config) if args.partition_config else None
        model = model_from_hf_config(args.model_type, _read_config(args.hf_config))
        print(describe_plan(model, args.tp, preset_model=args.preset_model, partition_config=partition))
    except (ValueError, json.JSONDecodeError) as exc:
        print(f"zerospeed tp-plan: {exc}", file=sys.stderr)
        return 2
    return 0
