"""Tensor parallelism x ZeRO accounting at world 4 = tp 2 x dp 2: the bytes each rank holds and the
tensor-parallel all-reduce volume, asserted exactly against the formulas.

Memory (fp32, AdamW; `engine.strategy.memory_breakdown()` after the second backward, before its step, so
parameters, gradients and optimizer states are all held). The elements of the tensor-parallel layers' full
weights and biases that are split, Ψ_sharded, are divided over the tp ranks; everything else, Ψ_rep
(embeddings, norms, lm_head, row-parallel biases), is whole on every rank. A rank holds
Ψ_local = Ψ_sharded / tp + Ψ_rep parameters, and ZeRO stage s over the dp ranks applies to Ψ_local as in
test_zero12.py / test_zero3.py: `zero.memory.estimate_model_states_memory(Ψ_local, s, dp, "fp32")` plus
only the documented padding (stages 1-2: the flat buffer is num_chunks equal chunks, each a multiple of dp,
< num_chunks * dp elements of padding; stage 3: each unit padded to a multiple of dp, < dp elements). Ψ is
counted twice, independently: from the unsharded model and the sharding plan, and in closed form from the
HF config.

All-reduce volume (comms logger, the second training step, forward + backward + step). Megatron-LM
(Shoeybi et al. 2019, §3; Narayanan et al. 2021, §3.2): per transformer layer and micro-batch, 2
all-reduces forward (the attention and MLP outputs, each b x s x h elements) and 2 backward (the attention
and MLP input gradients), 4bsh. ZeRO's data-parallel traffic at stages 1-3 is reduce-scatter / all-gather,
so every all_reduce is tensor-parallel except the two 1-element squared-norm reductions of the step (over
the dp group, then the tp group); at stage 0 the gradient buckets (Ψ_local elements) are all-reduced too
and the norm needs only the tp one. GPT-2 (fused q|k|v c_attn, one c_fc) does exactly Megatron's 4bsh.
HF Llama has three column layers q/k/v sharing one input and two, gate/up, sharing another; their parent
modules apply Megatron's f once for all of them (`tensor_parallel.layers.SharedInput`), so Llama does
4bsh too (one all-reduce per column *block*, not per column layer: 3 + 2 would be 7bsh).
"""
import math

import pytest
import torch
import torch.distributed as dist

import zerospeed
from zerospeed.tensor_parallel import plan_for_model
from zerospeed.testing.models import random_tokens, tiny_hf_gpt2, tiny_hf_llama
from zerospeed.testing.spawn import run_distributed
from zerospeed.zero.memory import BYTES_PER_PARAM, PARTITIONED, estimate_model_states_memory

pytest.importorskip("transformers")

TP, DP, WORLD = 2, 2, 4
MICRO, SEQ = 2, 32
# elements: stages 0-2 cut Ψ_local into several buckets / 3 chunks, and stages 1-2 pad the flat buffer
# (Llama: Ψ_local 69,952 -> 3 x 23,318 = 69,954; GPT-2: 70,976 -> 3 x 23,660 = 70,980)
BUCKET = 30_000
BUILD = {"llama": tiny_hf_llama, "gpt2": tiny_hf_gpt2}
STAGES = (0, 1, 2, 3)
STATES = ("params", "grads", "optimizer_states", "master_weights")
# backward all-reduces per layer: Megatron's 2 (one per column block), and what each model's column layers do
MEGATRON_FWD, MEGATRON_BWD = 2, 2
COLUMN_LAYERS_PER_LAYER = {"llama": 1 + 1, "gpt2": 1 + 1}  # (q, k, v) + (gate, up) share f | c_attn + c_fc


def _config(stage):
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "gradient_clipping": 0.0, "tensor_parallel": {"autotp_size": TP}, "comms_logger": {"enabled": True},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET,
                                  "stage3_param_persistence_threshold": 0}}


def _stats(engine):
    return {k: (v.calls, v.elements) for k, v in engine.comms_logger.stats.items()}


def _layout_facts(strategy, stage):
    """What the ZeRO layout holds per rank: elements (Ψ_local), padded elements, chunk/bucket/unit counts."""
    if stage == 0:
        return {"numel": sum(p.numel() for p in strategy.params), "buckets": len(strategy.reducer.buffers),
                "bucket_elements": sum(b.numel() for b in strategy.reducer.buffers)}
    if stage in (1, 2):
        lay = strategy.layout
        return {"numel": lay.numel, "padded": lay.padded_numel, "chunks": lay.num_chunks}
    return {"numel": sum(u.layout.numel for u in strategy.units),
            "padded": sum(u.layout.padded_numel for u in strategy.units),
            "unit_padding": [u.layout.padding for u in strategy.units]}


def accounting_runs(rank, world, kinds):
    out = {}
    tokens = random_tokens(MICRO * DP * 2, SEQ, seed=1)[:, :SEQ]
    for kind in kinds:
        for stage in STAGES:
            engine, *_ = zerospeed.initialize(model=BUILD[kind](seed=0), config=_config(stage))
            assert engine.dp_world_size == DP
            dp_rank = dist.get_rank(engine.group)
            res = {}
            for step in range(2):
                x = tokens[(step * DP + dp_rank) * MICRO:(step * DP + dp_rank + 1) * MICRO]
                engine.comms_logger.reset()
                loss = engine(input_ids=x, labels=x).loss
                res["forward"] = _stats(engine)
                engine.comms_logger.reset()
                engine.backward(loss)
                res["backward"] = _stats(engine)
                res["memory"] = engine.strategy.memory_breakdown()
                engine.comms_logger.reset()
                engine.step()
                res["step"] = _stats(engine)
            res["layout"] = _layout_facts(engine.strategy, stage)
            out[(kind, stage)] = res
            engine.destroy()
    return out


# -- the formulas ------------------------------------------------------------------------------------
def split_counts(kind):
    """(Ψ_sharded, Ψ_rep) from the unsharded model and its sharding plan: the weight of every planned
    column/row layer and a column layer's bias are split; a row layer's bias and every other parameter
    (embeddings, norms, lm_head; a tied weight once) are replicated."""
    model = BUILD[kind](seed=0)
    plan = plan_for_model(model)
    sharded, rep = 0, 0
    owner = {}
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            owner.setdefault(id(p), (mname, pname, p))
    for mname, pname, p in owner.values():
        rule = plan.rule_for(f"{mname}.weight")
        split = rule is not None and rule.partition_type != "skip" and (
            pname == "weight" or rule.partition_type == "column")
        if split:
            sharded += p.numel()
        else:
            rep += p.numel()
    return sharded, rep


def closed_form_counts(kind):
    """(Ψ_sharded, Ψ_rep) in closed form from the HF config."""
    cfg = BUILD[kind](seed=0).config
    if kind == "llama":  # no biases; q/o: h x h, k/v: h x kv*hd, gate/up/down: h x I; untied lm_head
        h, i, v, n = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
        kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
        sharded = n * (2 * h * h + 2 * h * kv + 3 * h * i)
        rep = 2 * v * h + n * 2 * h + h  # embed_tokens, lm_head; 2 RMSNorms per layer; the final norm
        return sharded, rep
    h, v, p, n = cfg.n_embd, cfg.vocab_size, cfg.n_positions, cfg.n_layer
    i = cfg.n_inner or 4 * h
    # column: c_attn [h, 3h] + bias 3h, c_fc [h, i] + bias i; row: attn c_proj [h, h], mlp c_proj [i, h]
    sharded = n * (3 * h * h + 3 * h + h * i + i + h * h + i * h)
    # wte (tied to lm_head: once), wpe, per layer ln_1/ln_2 (weight + bias) and the row biases; ln_f
    rep = v * h + p * h + n * (4 * h + 2 * h) + 2 * h
    return sharded, rep


def expected_memory(stage, psi, layout):
    """Bytes per rank, fp32 AdamW, ZeRO `stage` over DP ranks on `psi` local parameters, with the
    layout's padding: partitioned states hold padded/DP elements, stages 1-2 keep the whole padded
    flat buffer of parameters (and, stage 1, of gradients), stage 0 holds exactly Ψ."""
    padded = psi if stage == 0 else layout["padded"]
    per = BYTES_PER_PARAM["fp32"]
    return {state: per[state] * (padded // DP if state in PARTITIONED[stage] else padded) for state in STATES}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(accounting_runs, WORLD, list(BUILD), timeout=300)


@pytest.mark.parametrize("kind", list(BUILD))
def test_model_state_bytes_per_rank_equal_the_tp_x_dp_formula(runs, kind):
    sharded, rep = split_counts(kind)
    assert (sharded, rep) == closed_form_counts(kind)
    assert sharded % TP == 0
    psi_local = sharded // TP + rep
    for stage in STAGES:
        for rank, r in enumerate(runs):
            res = r[(kind, stage)]
            lay, mem = res["layout"], res["memory"]
            assert lay["numel"] == psi_local, (kind, stage, rank, lay["numel"], psi_local)
            # the documented padding, and nothing else
            if stage in (1, 2):
                assert 0 < lay["padded"] - psi_local < lay["chunks"] * DP and lay["padded"] % (lay["chunks"] * DP) == 0
            if stage == 3:
                assert all(0 <= pad < DP for pad in lay["unit_padding"]) and lay["padded"] % DP == 0
            if stage == 0:
                assert lay["bucket_elements"] == psi_local
            want = expected_memory(stage, psi_local, lay)
            got = {k: mem[k] for k in STATES}
            assert got == want, (kind, stage, rank, got, want)
            # ...which is the ZeRO formula on Ψ_local up to that padding
            formula = estimate_model_states_memory(psi_local, stage, DP, "fp32")
            padded = lay.get("padded", psi_local)
            for state in STATES:
                slack = BYTES_PER_PARAM["fp32"][state] * (
                    padded // DP - math.ceil(psi_local / DP) if state in PARTITIONED[stage] else
                    (0 if stage == 3 else padded - psi_local))
                assert got[state] - formula[state] == slack, (kind, stage, state, got[state], formula[state])
    if kind == "llama":  # the tiny model is embedding-heavy: tp 2 holds 0.655 of one process's parameters
        assert psi_local / (sharded + rep) == pytest.approx(69952 / 106816)


@pytest.mark.parametrize("kind", list(BUILD))
def test_tensor_parallel_all_reduce_volume_per_layer(runs, kind):
    cfg = BUILD[kind](seed=0).config
    layers, h = cfg.num_hidden_layers, cfg.hidden_size
    bsh = MICRO * SEQ * h
    megatron = (MEGATRON_FWD + MEGATRON_BWD) * bsh * layers  # 4bsh per layer per micro-batch
    fwd_calls, bwd_calls = MEGATRON_FWD * layers, COLUMN_LAYERS_PER_LAYER[kind] * layers
    sharded, rep = split_counts(kind)
    psi_local = sharded // TP + rep
    for stage in STAGES:
        for rank, r in enumerate(runs):
            res = r[(kind, stage)]
            # forward: the row layers' outputs (o_proj / attn.c_proj, down_proj / mlp.c_proj)
            assert res["forward"]["all_reduce"] == (fwd_calls, fwd_calls * bsh), (kind, stage, rank, res["forward"])
            tp_bwd = res["backward"]["all_reduce"]
            if stage == 0:  # the data-parallel gradient buckets are all-reduced in the backward too
                buckets = res["layout"]["buckets"]
                tp_bwd = (tp_bwd[0] - buckets, tp_bwd[1] - psi_local)
            assert tp_bwd == (bwd_calls, bwd_calls * bsh), (kind, stage, rank, res["backward"])
            # the step: only the 1-element squared-norm all-reduces (dp group at stages 1-3, then tp group)
            norm_calls = 1 if stage == 0 else 2
            assert res["step"].get("all_reduce") == (norm_calls, norm_calls), (kind, stage, rank, res["step"])
            tp_elements = fwd_calls * bsh + bwd_calls * bsh
            assert tp_elements == megatron == 4 * bsh * layers  # exactly Megatron's formula, both models
