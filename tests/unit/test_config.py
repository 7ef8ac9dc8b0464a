"""zerospeed.config: parsing, DeepSpeed 0.19.8 keys/defaults/aliases, strictness and error messages."""
from __future__ import annotations

import base64
import json
import warnings
from pathlib import Path

import pydantic
import pytest
import torch

from zerospeed.config import (
    ConfigDeprecationWarning,
    ConfigError,
    ModelHints,
    OptimizerConfig,
    ZeroSpeedConfig,
    closest_key,
    load_config,
)
from zerospeed.config.zero import DEFAULT_REDUCE_BUCKET_SIZE

BASE = {"train_micro_batch_size_per_gpu": 2}


def cfg(**sections):
    """load_config on BASE plus the given top-level sections (dp_world_size=1)."""
    return load_config({**BASE, **sections})


def error(source, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(source, **kwargs)
    assert not isinstance(info.value, pydantic.ValidationError)
    assert "pydantic" not in str(info.value) and "errors.pydantic.dev" not in str(info.value)
    return str(info.value)


# --------------------------------------------------------------------------------------------
# sources


def test_load_from_dict_does_not_mutate_the_callers_dict():
    source = {**BASE, "bfloat16": {"enabled": True}, "zero_optimization": {"cpu_offload": True, "stage": 2}}
    snapshot = json.loads(json.dumps(source))
    with pytest.warns(ConfigDeprecationWarning):
        c = load_config(source)
    assert source == snapshot
    assert c.bf16.enabled and c.zero_optimization.offload_optimizer.device == "cpu"


def test_load_from_path_str_pathlike_json_string_and_base64(tmp_path):
    d = {"train_batch_size": 8, "zero_optimization": {"stage": 2}}
    text = json.dumps(d)
    path = tmp_path / "ds_config.json"
    path.write_text(text)
    b64 = base64.urlsafe_b64encode(text.encode()).decode()
    for source in (path, str(path), text, b64, b64.rstrip("=")):
        c = load_config(source, dp_world_size=2)
        assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.zero_optimization.stage) == (8, 4, 2)


def test_duplicate_key_in_file_is_an_error_naming_the_key(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "zero_optimization": {"stage": 2, "reduce_bucket_size": 1e6, '
                    '"stage": 3}}')
    msg = error(path)
    assert "duplicate key 'stage'" in msg and "dup.json" in msg


def test_duplicate_key_in_json_string():
    assert "duplicate key 'train_batch_size'" in error('{"train_batch_size": 8, "train_batch_size": 16}')


def test_hjson_file_is_rejected_with_line_and_column(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{\n  "train_batch_size": 8,\n  // a comment\n  "fp16": {"enabled": true}\n}\n')
    msg = error(path)
    assert "not valid JSON" in msg and "line 3" in msg and "column 3" in msg
    assert "// a comment" in msg and "hjson" in msg


def test_missing_file_and_garbage_string():
    assert "config file not found" in error("no_such_dir/ds_config.json")
    assert "not an existing file" in error("certainly not a config!")
    assert "must be a dict" in error(42)


# --------------------------------------------------------------------------------------------
# strictness: unknown, removed and unsupported keys


def test_unknown_key_at_depth_names_path_and_closest_key():
    msg = error({**BASE, "zero_optimization": {"stage": 2, "offload_optimizer": {"devcie": "cpu"}}})
    assert "zero_optimization.offload_optimizer.devcie" in msg
    assert "did you mean 'device'?" in msg


def test_unknown_top_level_key_is_not_ignored():
    # DeepSpeed issue #653: "gradient_clipp1ng" was silently accepted
    msg = error({**BASE, "gradient_clipp1ng": 1.0})
    assert "gradient_clipp1ng: unknown key; did you mean 'gradient_clipping'?" in msg


def test_unknown_key_with_auto_value_is_still_an_error():
    assert "zero_optimization.reduce_bucket_sise" in error({**BASE, "zero_optimization": {"reduce_bucket_sise": "auto"}})


def test_misplaced_key_points_to_where_it_belongs():
    msg = error({**BASE, "stage3_max_live_parameters": 1e9})
    assert "belongs at zero_optimization.stage3_max_live_parameters" in msg


@pytest.mark.parametrize("key", ["nebula", "compression_training", "amp", "quantize_training", "sparse_gradients",
                                 "eigenvalue", "sparse_attention", "elasticity", "graph_harvesting",
                                 "curriculum_learning", "progressive_layer_drop"])
def test_removed_top_level_keys(key):
    msg = error({**BASE, key: {"enabled": False}})
    assert f"{key}: '{key}' was removed from DeepSpeed" in msg and "0.19.8" in msg


@pytest.mark.parametrize("key,value", [("mics_shard_size", 4), ("mics_hierarchical_params_gather", False),
                                       ("zeropp_loco_param", {"err_beta": 0.8})])
def test_removed_zero_keys(key, value):
    msg = error({**BASE, "zero_optimization": {"stage": 3, key: value}})
    assert f"zero_optimization.{key}" in msg and "removed from DeepSpeed" in msg


@pytest.mark.parametrize("name", ["OneBitAdam", "onebitlamb", "ZeroOneAdam"])
def test_removed_optimizers(name):
    msg = error({**BASE, "optimizer": {"type": name, "params": {"lr": 1e-3}}})
    assert "optimizer.type" in msg and "removed from DeepSpeed in 0.19.8" in msg


@pytest.mark.parametrize("key,value", [
    ("compile", {"deepcompile": True}), ("hybrid_engine", {"enabled": True}), ("data_efficiency", {"enabled": True}),
    ("weight_quantization", {"post_init_quant": {}}), ("autotuning", {"enabled": True}),
    ("timers", {"throughput": {"enabled": False}}), ("comet", {"enabled": True}), ("sequence_parallel_size", 2),
    ("datastates_ckpt", {"enabled": True}),
])
def test_unsupported_top_level_keys(key, value):
    assert f"'{key}' is a DeepSpeed key that zerospeed does not support yet" in error({**BASE, key: value})


def test_expert_parallel_block_keeps_deepspeeds_keys():
    """AutoEP's block: DeepSpeed 0.19.8's keys; kernel knobs accepted, routing overrides and DeepEP refused."""
    block = {"enabled": True, "autoep_size": 2, "preset_model": "mixtral", "use_grouped_mm": False,
             "combine_impl": "weighted_sum", "comm_backend": "comm", "top_k": "auto", "score_func": "auto"}
    assert cfg(expert_parallel=block).expert_parallel.size == 2
    assert cfg(expert_parallel={"enabled": False, "autoep_size": 4}).expert_parallel.size == 1
    assert "expert_parallel.autoep_sise: unknown key; did you mean 'autoep_size'?" in \
        error({**BASE, "expert_parallel": {"enabled": True, "autoep_sise": 2}})
    for bad, says in (({"comm_backend": "deepep"}, "needs DeepEP"), ({"load_balance_coeff": 0.01}, "rejects it as well"),
                      ({"route_norm": True}, "keeps the model's own router"), ({"preset_model": "llama"}, "presets are"),
                      ({"expert_tensor_parallel_size": 2}, "not implemented yet")):
        assert says in error({**BASE, "expert_parallel": {"enabled": True, **bad}}), bad


@pytest.mark.parametrize("key,value", [("sequence_parallel_size", 1), ("compile", {"deepcompile": False}),
                                       ("hybrid_engine", {"enabled": False, "max_out_tokens": 512}),
                                       ("tensor_parallel", {}), ("autotuning", {"enabled": False})])
def test_unsupported_keys_at_their_default_are_accepted(key, value):
    assert cfg(**{key: value}).train_batch_size == 2


@pytest.mark.parametrize("zero", [{"zero_quantized_weights": True}, {"zero_quantized_gradients": True},
                                  {"zero_hpz_partition_size": 8}, {"zenflow": {"topk_ratio": 0.1}},
                                  {"legacy_stage1": True}])
def test_unsupported_zero_values(zero):
    assert "zerospeed does not support yet" in error({**BASE, "zero_optimization": {"stage": 3, **zero}})


@pytest.mark.parametrize("stage,device", [(2, "cpu"), (2, "nvme")])
def test_super_offload_needs_stage3(stage, device, tmp_path):
    opt = {"device": device, "super_offload": True, **({"nvme_path": str(tmp_path)} if device == "nvme" else {})}
    msg = error({**BASE, "zero_optimization": {"stage": stage, "offload_optimizer": opt}})
    assert "offload_optimizer.super_offload" in msg and f"not stage {stage} with device '{device}'" in msg


@pytest.mark.parametrize("device", ["nvme", "cpu"])
def test_super_offload_at_stage3_is_accepted(device, tmp_path):
    """With "cpu" (DeepSpeed's SuperOffload examples' config) the step runs at engine.step(), with a warning
    (tests/dist/test_offload.py)."""
    opt = {"device": device, "super_offload": True, **({"nvme_path": str(tmp_path)} if device == "nvme" else {})}
    assert cfg(zero_optimization={"stage": 3, "offload_optimizer": opt}).zero_optimization.offload_optimizer.super_offload


def test_all_problems_are_reported_together():
    msg = error({"train_batch_size": 33, "amp": {}, "pipeline": {"schedule": "dualpipe"}, "gradient_clipp1ng": 1.0,
                 "fp16": {"loss_scale_window": "x"}, "zero_optimization": {"offload_param": {"devcie": "cpu"}}},
                dp_world_size=2)
    assert "(6 problems)" in msg
    for fragment in ("amp:", "pipeline.schedule:", "train_batch_size=33", "gradient_clipp1ng", "fp16.loss_scale_window",
                     "zero_optimization.offload_param.devcie"):
        assert fragment in msg


def test_type_errors_show_path_value_and_expected_type():
    msg = error({**BASE, "zero_optimization": {"reduce_bucket_size": "big"}, "steps_per_print": 2.5})
    assert "zero_optimization.reduce_bucket_size" in msg and "'big'" in msg and "expected int" in msg
    assert "steps_per_print" in msg and "2.5" in msg
    assert "fp16: expected a JSON object" in error({**BASE, "fp16": True})


def test_closest_key_helper():
    assert closest_key("devcie", ["device", "nvme_path"]) == "device"
    assert closest_key("ADAMW", ["Adam", "AdamW"]) == "AdamW"
    assert closest_key("zzz", ["device"]) is None


# --------------------------------------------------------------------------------------------
# defaults and DeepSpeed semantics


def test_defaults_match_deepspeed_0_19_8():
    c = cfg()
    assert c.gradient_clipping == 1.0  # 0.0 before DeepSpeed 0.19
    assert c.managed_gradient_accumulation is True and c.steps_per_print is None
    assert c.effective_steps_per_print == 10
    assert (c.fp16.enabled, c.fp16.loss_scale, c.fp16.initial_scale_power, c.fp16.loss_scale_window,
            c.fp16.hysteresis, c.fp16.consecutive_hysteresis, c.fp16.min_loss_scale) == (False, 0, 16, 1000, 2, False, 1)
    assert c.fp16.dynamic_loss_scale and c.fp16.initial_dynamic_scale == 65536
    assert (c.bf16.enabled, c.bf16.immediate_grad_update, c.bf16.check_grad_overflow) == (False, False, True)
    z = c.zero_optimization
    assert (z.stage, z.reduce_bucket_size, z.allgather_bucket_size, z.prefetch_bucket_size) == (0, 500_000_000,
                                                                                               500_000_000, 50_000_000)
    assert (z.param_persistence_threshold, z.max_live_parameters, z.max_reuse_distance, z.sub_group_size) == (
        100_000, 1_000_000_000, 1_000_000_000, 1_000_000_000)
    assert z.contiguous_gradients and z.reduce_scatter and z.offload_param is None and z.offload_optimizer is None
    assert (c.comms_logger.enabled, c.comms_logger.prof_all, c.comms_logger.prof_ops) == (False, True, [])
    assert (c.flops_profiler.profile_step, c.flops_profiler.module_depth, c.flops_profiler.detailed) == (1, -1, True)
    assert (c.aio.block_size, c.aio.queue_depth, c.aio.overlap_events) == (1_048_576, 8, True)
    assert c.checkpoint.tag_validation == "Warn" and c.wandb.project == "deepspeed"
    assert c.tensorboard.job_name == "DeepSpeedJobName" and c.gradient_allreduce_op == "mean"
    assert c.zero_force_ds_cpu_optimizer is True and c.seed is None and c.precision == "fp32"


def test_gradient_clipping_values():
    assert cfg(gradient_clipping="auto").gradient_clipping == 1.0
    assert cfg(gradient_clipping=0).gradient_clipping == 0.0
    assert "gradient_clipping" in error({**BASE, "gradient_clipping": -1})


def test_fp16_and_bf16_together_is_an_error():
    msg = error({**BASE, "fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert "fp16.enabled and bf16.enabled are both true" in msg


@pytest.mark.parametrize("value", [-1, float("inf"), float("nan"), True])
def test_fp16_loss_scale_must_be_finite_non_negative(value):
    assert "fp16.loss_scale" in error({**BASE, "fp16": {"enabled": True, "loss_scale": value}})


def test_bf16_master_weights_need_zero():
    assert "bf16.bf16_master_weights_and_grads: needs ZeRO stage" in error(
        {**BASE, "bf16": {"enabled": True, "bf16_master_weights_and_grads": True}})
    assert "needs bf16.bf16_master_weights_and_grads" in error(
        {**BASE, "zero_optimization": {"stage": 1}, "bf16": {"enabled": True, "bf16_optimizer_states": True}})


def test_bfloat16_alias():
    with pytest.warns(ConfigDeprecationWarning, match="bfloat16"):
        assert cfg(bfloat16={"enabled": True}).bf16.enabled
    assert "keep only 'bf16'" in error({**BASE, "bfloat16": {"enabled": True}, "bf16": {"enabled": True}})


@pytest.mark.parametrize("stage", [4, 7])
def test_stage_above_3_is_an_error(stage):
    assert f"ZeRO stage {stage} does not exist" in error({**BASE, "zero_optimization": {"stage": stage}})


@pytest.mark.parametrize("stage,expected", [(0, False), (1, False), (2, False), (3, True)])
def test_overlap_comm_default_depends_on_stage(stage, expected):
    assert cfg(zero_optimization={"stage": stage}).zero_optimization.overlap_comm is expected
    assert cfg(zero_optimization={"stage": stage, "overlap_comm": not expected}).zero_optimization.overlap_comm \
        is (not expected)


def test_reduce_bucket_elements_honours_a_set_key_and_picks_the_default_otherwise():
    """The bucket size zero/ receives: the configured one when the key is set, else DDP's 25 MiB of fp32."""
    assert DEFAULT_REDUCE_BUCKET_SIZE == 6_553_600  # 25 MiB of fp32, DDP's bucket_cap_mb
    given = cfg(zero_optimization={"reduce_bucket_size": 500_000_000}).zero_optimization
    assert given.reduce_bucket_elements == 500_000_000  # DeepSpeed's value, given explicitly
    absent = cfg(zero_optimization={"stage": 2}).zero_optimization
    assert absent.reduce_bucket_size == 500_000_000 and absent.reduce_bucket_elements == DEFAULT_REDUCE_BUCKET_SIZE
    assert cfg(zero_optimization={"reduce_bucket_size": 20_000}).zero_optimization.reduce_bucket_elements == 20_000
    assert "zero_optimization.reduce_bucket_size" in error({**BASE, "zero_optimization": {"reduce_bucket_size": 0}})


def test_boolean_zero_optimization_means_stage_1():
    with pytest.warns(ConfigDeprecationWarning):
        assert cfg(zero_optimization=True).zero_optimization.stage == 1
    with pytest.warns(ConfigDeprecationWarning):
        assert cfg(zero_optimization=False).zero_optimization.stage == 0


def test_zero_aliases():
    by_alias = cfg(zero_optimization={"stage": 3, "stage3_prefetch_bucket_size": 1e7,
                                      "stage3_param_persistence_threshold": 1e4, "stage3_max_live_parameters": 3e8,
                                      "stage3_max_reuse_distance": 2e8,
                                      "stage3_gather_16bit_weights_on_model_save": True}).zero_optimization
    by_name = cfg(zero_optimization={"stage": 3, "prefetch_bucket_size": 10_000_000, "param_persistence_threshold": 10_000,
                                     "max_live_parameters": 300_000_000, "max_reuse_distance": 200_000_000,
                                     "gather_16bit_weights_on_model_save": True}).zero_optimization
    assert by_alias == by_name
    assert by_alias.prefetch_bucket_size == 10_000_000 and by_alias.gather_16bit_weights_on_model_save
    msg = error({**BASE, "zero_optimization": {"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2}})
    assert "given both as 'stage3_prefetch_bucket_size' and as 'prefetch_bucket_size'" in msg


def test_deprecated_zero_keys_are_remapped_with_a_warning():
    with pytest.warns(ConfigDeprecationWarning, match="cpu_offload"):
        z = cfg(zero_optimization={"stage": 2, "cpu_offload": True}).zero_optimization
    assert z.offload_optimizer.device == "cpu" and z.offload_optimizer.pin_memory is True
    with pytest.warns(ConfigDeprecationWarning, match="cpu_offload_param"):
        z = cfg(zero_optimization={"stage": 3, "cpu_offload_param": True}).zero_optimization
    assert z.offload_param.device == "cpu"
    with pytest.warns(ConfigDeprecationWarning):
        z = cfg(zero_optimization={"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}).zero_optimization
    assert z.gather_16bit_weights_on_model_save
    with pytest.warns(ConfigDeprecationWarning):
        assert cfg(zero_optimization={"stage": 2, "cpu_offload": False}).zero_optimization.offload_optimizer is None


@pytest.mark.parametrize("zero", [{"cpu_offload": True, "offload_optimizer": {"device": "cpu"}},
                                  {"cpu_offload_param": True, "offload_param": {"device": "cpu"}},
                                  {"stage3_gather_fp16_weights_on_model_save": True,
                                   "stage3_gather_16bit_weights_on_model_save": True}])
def test_deprecated_key_with_its_replacement_is_an_error(zero):
    assert "deprecated key given together with its replacement" in error({**BASE, "zero_optimization": {"stage": 3,
                                                                                                       **zero}})


def test_offload_rules():
    assert "needs ZeRO stage 3" in error({**BASE, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    assert "needs ZeRO stage 1, 2 or 3" in error({**BASE, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}})
    assert "nvme_path" in error({**BASE, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    assert "partial offload" in error({**BASE, "zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "cpu", "ratio": 0.5}}})
    assert "device" in error({**BASE, "zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}})
    assert "compute_grad_norm: false is only supported with stage 1 or 2" in error(
        {**BASE, "zero_optimization": {"stage": 3, "compute_grad_norm": False}})
    z = cfg(zero_optimization={"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}}).zero_optimization
    assert z.offload_param.enabled and z.offload_param.nvme_path == Path("/local_nvme")
    assert (z.offload_param.buffer_count, z.offload_param.buffer_size, z.offload_param.max_in_cpu) == (5, 10**8, 10**9)


def test_gradient_allreduce_op():
    assert cfg(gradient_allreduce_op="SUM", zero_optimization={"stage": 2}).gradient_allreduce_op == "sum"
    assert "'sum' is not supported with ZeRO stage 3" in error(
        {**BASE, "gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}})
    assert "gradient_allreduce_op" in error({**BASE, "gradient_allreduce_op": "max"})


def test_small_sections():
    c = cfg(communication_data_type="BF16", checkpoint={"tag_validation": "fail"}, seed=1234,
            torch_autocast={"enabled": True, "dtype": "torch.bfloat16"}, data_types={"grad_accum_dtype": "float32"},
            activation_checkpointing={"partition_activations": True, "number_checkpoints": 4}, log_level="INFO")
    assert c.communication_data_type == "bf16" and c.checkpoint.tag_validation == "Fail" and c.seed == 1234
    assert c.torch_autocast.dtype == "bf16" and c.torch_autocast.torch_dtype is torch.bfloat16
    assert c.data_types.grad_accum_dtype == "fp32" and c.activation_checkpointing.number_checkpoints == 4
    assert c.log_level == "info"
    assert "communication_data_type" in error({**BASE, "communication_data_type": "int8"})
    assert "checkpoint.tag_validation" in error({**BASE, "checkpoint": {"tag_validation": "Maybe"}})
    assert "flops_profiler.step: unknown key" in error({**BASE, "flops_profiler": {"enabled": True, "step": 2}})


def test_config_is_frozen():
    c = cfg()
    with pytest.raises(pydantic.ValidationError):
        c.gradient_clipping = 0.5
    with pytest.raises(pydantic.ValidationError):
        c.zero_optimization.stage = 3


# --------------------------------------------------------------------------------------------
# optimizer


@pytest.mark.parametrize("type_,params,torch_name", [
    ("Adam", {}, "AdamW"),  # DeepSpeed: "Adam" means AdamW unless adam_w_mode is false
    ("adam", {"adam_w_mode": True}, "AdamW"),
    ("Adam", {"adam_w_mode": False}, "Adam"),
    ("AdamW", {"adam_w_mode": False}, "AdamW"),  # AdamW is always AdamW
    ("ADAMW", {}, "AdamW"),
    ("sgd", {"momentum": 0.9}, "SGD"),
    ("Adagrad", {}, "Adagrad"),
    ("rmsprop", {}, "RMSprop"),
])
def test_optimizer_type_and_adam_w_mode(type_, params, torch_name):
    o = cfg(optimizer={"type": type_, "params": {"lr": 0.01, **params}}).optimizer
    assert o.type.lower() == type_.lower() and o.type in ("Adam", "AdamW", "SGD", "Adagrad", "RMSprop")
    assert o.torch_class_name == torch_name
    kwargs = o.torch_kwargs()
    assert "adam_w_mode" not in kwargs and "torch_adam" not in kwargs
    opt = getattr(torch.optim, o.torch_class_name)([torch.nn.Parameter(torch.zeros(2))], **kwargs)
    assert opt.param_groups[0]["lr"] == 0.01


def test_optimizer_kwargs():
    o = cfg(optimizer={"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                   "torch_adam": True, "bias_correction": True}}).optimizer
    assert o.torch_kwargs() == {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}
    assert o.fused_kernel is False  # torch_adam: torch's own implementation, as in DeepSpeed
    assert cfg(optimizer={"type": "Adam", "params": {}}).optimizer.fused_kernel is True  # DeepSpeed's FusedAdam
    assert cfg(optimizer={"type": "AdamW", "params": {"torch_adam": False}}).optimizer.fused_kernel is True
    assert cfg(optimizer={"type": "SGD", "params": {"lr": 0.1}}).optimizer.fused_kernel is False
    assert cfg(optimizer={"type": "AdamW", "params": {"weight_decay": 0.1}}).optimizer.torch_kwargs()["weight_decay"] == 0.1
    assert "weight_decay" not in cfg(optimizer={"type": "SGD", "params": {"lr": 0.1}}).optimizer.torch_kwargs()


def test_max_grad_norm_in_optimizer_params_is_an_error():
    msg = error({**BASE, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}})
    assert "optimizer.params.max_grad_norm" in msg and "gradient_clipping" in msg


def test_unknown_optimizer_param_names_the_closest_torch_kwarg():
    msg = error({**BASE, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "weight_decy": 0.1}}})
    assert "optimizer.params.weight_decy" in msg and "did you mean 'weight_decay'?" in msg
    assert "did you mean 'momentum'?" in error({**BASE, "optimizer": {"type": "SGD", "params": {"momentun": 0.9}}})


@pytest.mark.parametrize("params,fragment", [
    ({"betas": [0.9]}, "optimizer.params.betas"), ({"lr": -1}, "optimizer.params.lr"),
    ({"bias_correction": False}, "bias_correction"), ({"adam_w_mode": "no"}, "adam_w_mode"),
])
def test_bad_optimizer_values(params, fragment):
    assert fragment in error({**BASE, "optimizer": {"type": "Adam", "params": params}})


def test_optimizer_switch_outside_params_is_an_error():
    assert "put it inside optimizer.params" in error({**BASE, "optimizer": {"type": "Adam", "adam_w_mode": False}})


@pytest.mark.parametrize("name,fragment", [("Muon", "does not support yet"),
                                           ("Adamm", "did you mean 'Adam'? supported: Adam, AdamW, SGD, Adagrad, RMSprop"),
                                           ("FusedAdam", "supported: Adam, AdamW")])
def test_other_optimizer_types(name, fragment):
    assert fragment in error({**BASE, "optimizer": {"type": name}})
    assert "optimizer.type: required" in error({**BASE, "optimizer": {"params": {"lr": 1}}})


def test_auto_optimizer_params_from_client_optimizer():
    client = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=3e-4, betas=(0.8, 0.9), eps=1e-6,
                               weight_decay=0.05)
    section = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
    o = load_config({**BASE, "optimizer": section}, client_optimizer=client).optimizer
    assert o.params == {"lr": 3e-4, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.05}
    assert o.torch_kwargs()["betas"] == (0.8, 0.9)
    msg = error({**BASE, "optimizer": section})
    for key in ("lr", "betas", "eps", "weight_decay"):
        assert f"optimizer.params.{key}: is 'auto' but no client optimizer" in msg
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    assert "optimizer.params.betas: is 'auto' but the client optimizer has no such" in error(
        {**BASE, "optimizer": section}, client_optimizer=sgd)
    assert "'auto' is only supported for" in error({**BASE, "optimizer": {"type": "Adam", "params": {"amsgrad": "auto"}}})


def test_optimizer_config_can_be_built_directly():
    o = OptimizerConfig(type="adam", params={"lr": 1e-3, "adam_w_mode": False})
    assert (o.type, o.torch_class_name, o.torch_kwargs()) == ("Adam", "Adam", {"lr": 1e-3, "weight_decay": 0.0})


# --------------------------------------------------------------------------------------------
# scheduler


def test_scheduler_defaults_filled():
    s = cfg(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 10}}).scheduler
    assert s.kwargs() == {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 10, "warmup_type": "log",
                          "last_batch_iteration": -1}
    s = cfg(scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": 100}}).scheduler
    assert s.kwargs()["warmup_max_lr"] == 0.001 and s.kwargs()["warmup_type"] == "log"
    s = cfg(scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": 100}}).scheduler
    assert s.kwargs()["cos_min_ratio"] == 0.0001 and s.kwargs()["warmup_min_ratio"] == 0.0
    s = cfg(scheduler={"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}).scheduler
    assert (s.kwargs()["cycle_first_step_size"], s.kwargs()["cycle_momentum"], s.kwargs()["cycle_min_mom"]) == (2000, True, 0.8)
    s = cfg(scheduler={"type": "LRRangeTest"}).scheduler
    assert s.kwargs() == {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 2000,
                          "lr_range_test_step_rate": 1.0, "lr_range_test_staircase": False,
                          "last_batch_iteration": -1}


@pytest.mark.parametrize("type_", ["WarmupDecayLR", "WarmupCosineLR"])
def test_scheduler_required_total_num_steps(type_):
    assert f"scheduler.params.total_num_steps: {type_} requires 'total_num_steps'" in error(
        {**BASE, "scheduler": {"type": type_, "params": {"warmup_num_steps": 10}}})
    assert "cannot derive it" in error({**BASE, "scheduler": {"type": type_, "params": {"total_num_steps": "auto"}}})


def test_scheduler_errors():
    assert "scheduler.params.warmup_max_lrr: unknown key; did you mean 'warmup_max_lr'?" in error(
        {**BASE, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lrr": 1e-3}}})
    assert "did you mean 'WarmupLR'?" in error({**BASE, "scheduler": {"type": "warmuplr"}})
    assert "scheduler.params.warmup_type" in error({**BASE, "scheduler": {"type": "WarmupLR", "params": {
        "warmup_type": "cosine"}}})
    assert "scheduler.params.warmup_num_steps" in error({**BASE, "scheduler": {"type": "WarmupLR", "params": {
        "warmup_num_steps": 0}}})
    assert "OneCycle requires 'cycle_min_lr'" in error({**BASE, "scheduler": {"type": "OneCycle"}})


def test_scheduler_auto_params():
    s = cfg(optimizer={"type": "AdamW", "params": {"lr": 5e-4}},
            scheduler={"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                           "total_num_steps": 50}}).scheduler
    assert (s.kwargs()["warmup_min_lr"], s.kwargs()["warmup_max_lr"], s.kwargs()["warmup_num_steps"]) == (0.0, 5e-4, 1000)
    # warmup_num_steps: "auto" is an error (HF fills it from the Trainer): tests/unit/test_config_auto.py


def test_torch_scheduler_by_name_as_in_deepspeed():
    s = cfg(scheduler={"type": "StepLR", "params": {"step_size": 10, "gamma": 0.5}}).scheduler
    assert s.type == "StepLR" and s.kwargs() == {"step_size": 10, "gamma": 0.5}
    assert "did you mean 'gamma'?" in error({**BASE, "scheduler": {"type": "StepLR", "params": {"step_size": 1,
                                                                                              "gama": 0.5}}})
    assert "StepLR requires 'step_size'" in error({**BASE, "scheduler": {"type": "StepLR"}})


# --------------------------------------------------------------------------------------------
# realistic configs

# deepspeed.ai/tutorials/zero/ "Training a 10B Parameter GPT-2 model" (ZeRO-2)
ZERO2_TUTORIAL = {
    "train_batch_size": 32,
    "zero_optimization": {
        "stage": 2,
        "contiguous_gradients": True,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 5e8,
        "allgather_bucket_size": 5e8,
    },
}

# deepspeed.ai/tutorials/zero/ "Offloading to CPU and NVMe with ZeRO-Infinity" (ZeRO-3)
ZERO3_TUTORIAL = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {
        "stage": 3,
        "contiguous_gradients": True,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_prefetch_bucket_size": 1e7,
        "stage3_param_persistence_threshold": 1e5,
        "reduce_bucket_size": 1e7,
        "sub_group_size": 1e9,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
    },
}

# The Hugging Face Trainer's ZeRO-3 template (transformers docs), with the micro-batch and the
# warm-up steps the Trainer would have filled in (zerospeed cannot derive those).
HF_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": 1}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": 4,
    "wall_clock_breakdown": False,
}


def test_zero2_tutorial_config():
    c = load_config(ZERO2_TUTORIAL, dp_world_size=4)
    z = c.zero_optimization
    assert (c.train_micro_batch_size_per_gpu, z.stage, z.overlap_comm, z.reduce_bucket_size) == (8, 2, True, 500_000_000)
    assert isinstance(z.reduce_bucket_size, int) and isinstance(z.allgather_bucket_size, int)


def test_zero3_tutorial_config():
    c = load_config(ZERO3_TUTORIAL, dp_world_size=8)
    z = c.zero_optimization
    assert c.train_batch_size == 8 and z.stage == 3 and z.overlap_comm is True
    assert (z.prefetch_bucket_size, z.param_persistence_threshold, z.reduce_bucket_size) == (10**7, 10**5, 10**7)
    assert z.offload_optimizer.device == "cpu" and z.offload_param.device == "cpu" and z.offload_param.pin_memory


def test_hf_trainer_style_auto_config(tmp_path):
    path = tmp_path / "ds_config_zero3.json"
    path.write_text(json.dumps(HF_ZERO3, indent=2))
    client = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=2e-5, weight_decay=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing deprecated in the template
        c = load_config(path, dp_world_size=2, client_optimizer=client, model=ModelHints(hidden_size=1024))
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (8, 4, 1)
    assert c.gradient_clipping == 1.0 and c.precision == "fp32" and c.steps_per_print == 2000
    assert c.optimizer.torch_class_name == "AdamW"
    assert c.optimizer.torch_kwargs() == {"lr": 2e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    assert c.scheduler.kwargs()["warmup_max_lr"] == 2e-5 and c.scheduler.kwargs()["warmup_min_lr"] == 0.0
    z = c.zero_optimization
    # the hidden-size "auto" keys get HF's formulas (tests/unit/test_config_auto.py has the rest)
    assert (z.reduce_bucket_size, z.prefetch_bucket_size, z.param_persistence_threshold) == (1024**2, 943718, 10240)
    assert z.reduce_bucket_elements == 1024**2  # a resolved "auto" counts as set
    assert z.gather_16bit_weights_on_model_save and z.offload_param.device == "cpu"


def test_model_validate_directly_raises_pydantic_error_with_context():
    c = ZeroSpeedConfig.model_validate({"train_batch_size": 16}, context={"dp_world_size": 4})
    assert c.train_micro_batch_size_per_gpu == 4 and c.dp_world_size == 4
    assert c.zero_stage == 0


def test_pipeline_block():
    cfg = load_config({**BASE, "pipeline": {"stages": 2, "partition": "parameters", "schedule": "zb_h1"}})
    assert (cfg.pipeline.stages, cfg.pipeline.schedule, cfg.pipeline.pipe_partitioned) == (2, "zb_h1", True)
    assert load_config(BASE).pipeline.schedule == "1f1b"  # DeepSpeed's TrainSchedule by default
    assert "pipeline.schedule" in error({**BASE, "pipeline": {"schedule": "dualpipe"}})
    assert "did you mean 'schedule'" in error({**BASE, "pipeline": {"schedul": "gpipe"}})
