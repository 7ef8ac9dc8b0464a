"""AutoEP (issue 25): `"expert_parallel": {"enabled": true, "autoep_size": 2}` on unmodified tiny Hugging Face MoE
models (Mixtral, Qwen3-MoE, DeepSeek-V3: random init from a config) on real gloo ranks, against the unmodified
model trained in one process on the same global batch (each rank's micro-batch run separately, the loss the
mean over ranks, the router auxiliary loss the model's own): per-step losses equal to 1e-5 relative (fp32),
and each rank's experts equal the reference's rows of the full expert tensors after the steps."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zerospeed.testing.spawn import run_distributed

transformers = pytest.importorskip("transformers")

STEPS, BATCH, SEQ, VOCAB, E = 3, 2, 8, 64, 4


def _model(kind: str, kv_heads: int = 1):
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                  max_position_embeddings=32, output_router_logits=True, router_aux_loss_coef=0.02,
                  attn_implementation="eager")
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=32, num_key_value_heads=kv_heads, num_local_experts=E,
                                         num_experts_per_tok=2, **common)
        return transformers.MixtralForCausalLM(cfg)
    if kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(intermediate_size=32, moe_intermediate_size=16, num_key_value_heads=1,
                                          num_experts=E, num_experts_per_tok=2, head_dim=8, norm_topk_prob=True,
                                          **common)
        return transformers.Qwen3MoeForCausalLM(cfg)
    cfg = transformers.DeepseekV3Config(intermediate_size=32, moe_intermediate_size=16, num_key_value_heads=2,
                                        n_routed_experts=E, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                                        topk_group=1, first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=None,
                                        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, **common)
    return transformers.DeepseekV3ForCausalLM(cfg)


def _batches(world: int):
    g = torch.Generator().manual_seed(3)
    return [[torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(world)] for _ in range(STEPS)]


def _reference(kind: str, world: int, kv_heads: int = 1):
    model = _model(kind, kv_heads)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    losses = []
    for batch in _batches(world):
        out = [model(input_ids=ids, labels=ids).loss for ids in batch]
        opt.zero_grad()
        (sum(out) / world).backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        losses.append([float(x.detach()) for x in out] + [norm])
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage},
            "expert_parallel": {"enabled": True, "autoep_size": 2, "use_grouped_mm": True}}


# AutoTP over the attention (q/k/v column-parallel, o row-parallel); the router and experts stay whole
TP_BLOCK = {"autotp_size": 2, "partition_config": {"use_default_specs": False, "layer_specs": [
    {"patterns": [r".*self_attn\.(q|k|v)_proj\.weight$"], "partition_type": "column"},
    {"patterns": [r".*self_attn\.o_proj\.weight$"], "partition_type": "row"}]}}


def _run(rank: int, world: int, kind: str, stage: int, tp: int = 1, tp_model_init: bool = False):
    import zerospeed
    from zerospeed.moe.autoep import ExpertParallelExperts
    from zerospeed.tensor_parallel import tensor_parallel_layers

    cfg = _config(stage)
    model = _model(kind, 2 if tp > 1 else 1)
    if tp_model_init:  # sharded before initialize (its mesh has no expert groups yet: initialize carves them)
        model = zerospeed.tp_model_init(model, tp_size=tp, dtype=torch.float32, config={"tensor_parallel": TP_BLOCK})
    elif tp > 1:
        cfg["tensor_parallel"] = TP_BLOCK
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    blocks = [m for m in engine.module.modules() if isinstance(m, ExpertParallelExperts)]
    assert blocks and all(b.num_local_experts == E // 2 for b in blocks)
    data_rank = dist.get_rank(engine.group)  # the tensor-parallel ranks of one replica read the same batch
    losses = []
    for batch in _batches(world // tp):
        ids = batch[data_rank]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append((float(loss.detach()), engine.get_global_grad_norm()))
    specs = {f"{name}.{pn}": s for name, layer in tensor_parallel_layers(engine.module)
             for pn, s in layer.shard_specs.items() if s is not None}  # the tensor-parallel shards held here
    return losses, {n: p.detach().clone() for n, p in engine.module.named_parameters()}, engine.mesh.rank("expert"), \
        data_rank, specs


@pytest.mark.parametrize("kind,world,stage,tp,tp_init", [
    ("mixtral", 2, 0, 1, False), ("mixtral", 4, 2, 1, False), ("qwen3_moe", 2, 2, 1, False),
    ("qwen3_moe", 4, 0, 1, False), ("deepseek_v3", 2, 2, 1, False), ("mixtral", 4, 0, 2, False),
    ("mixtral", 4, 2, 2, False), ("mixtral", 4, 2, 2, True)])
def test_autoep_trains_as_the_unmodified_model(kind, world, stage, tp, tp_init):
    """tp 2 (world 4): AutoTP over the attention and AutoEP at ep 2 over each tensor rank's data group; the
    attention sharded by the config's tensor_parallel block, or (tp_init) by zerospeed.tp_model_init first."""
    results = run_distributed(_run, world, kind, stage, tp, tp_init)
    ref_losses, ref_params = _reference(kind, world // tp, 2 if tp > 1 else 1)
    from zerospeed.tensor_parallel import shard_tensor

    for rank, (losses, params, ep_rank, data_rank, specs) in enumerate(results):
        assert len(specs) == (8 if tp > 1 else 0)  # q, k, v, o of 2 layers
        for step, (loss, norm) in enumerate(losses):
            assert loss == pytest.approx(ref_losses[step][data_rank], rel=1e-5), (step, rank)
            # the global norm (every expert and every shard once; clipping at 1.0 is active when it is larger)
            assert norm == pytest.approx(ref_losses[step][-1], rel=1e-5), (step, rank)
        assert set(params) == set(ref_params)
        for n, p in params.items():
            want = ref_params[n]
            if n.endswith(("experts.gate_up_proj", "experts.down_proj")):  # this rank's E / 2 rows
                want = want[ep_rank * (E // 2):(ep_rank + 1) * (E // 2)]
            if n in specs:
                want = shard_tensor(want, specs[n])
            torch.testing.assert_close(p, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"rank {rank} {n} {m}")


def test_autoep_bad_configs():
    import zerospeed
    from zerospeed.config import ConfigError

    def cfg(**kw):
        return {**_config(0), "expert_parallel": {"enabled": True, "autoep_size": 2, **kw}}

    with pytest.raises(ConfigError, match=r"preset_model='qwen3_moe' is for model type\(s\) \['qwen3_moe'\].*'mixtral'"):
        zerospeed.initialize(model=_model("mixtral"), config=cfg(preset_model="qwen3_moe"))
    with pytest.raises(ConfigError, match="top_k=1 but the model routes to 2 experts per token"):
        zerospeed.initialize(model=_model("mixtral"), config=cfg(top_k=1))
    with pytest.raises(ConfigError, match="autoep_size=3 does not divide the 4 experts of model.layers.0.mlp"):
        zerospeed.initialize(model=_model("mixtral"), config=cfg(autoep_size=3))
    with pytest.raises(ConfigError, match="no MoE block with transformers' fused experts"):
        zerospeed.initialize(model=torch.nn.Linear(4, 4), config=cfg())
    with pytest.raises(ConfigError, match="score_func='sigmoid': zerospeed's AutoEP keeps the model's own routing"):
        zerospeed.initialize(model=_model("mixtral"), config=cfg(score_func="sigmoid"))


def _save_run(rank: int, world: int, ckpt: str, mode: str, ep: int, tp: int = 1):
    """mode "save": 2 steps at `ep` (and tensor-parallel size `tp`), save_checkpoint + save_16bit_model, a 3rd
    step; "resume": load, the 3rd step. Returns the 3rd step's loss and this rank's data-parallel rank."""
    import zerospeed

    cfg = _config(2)
    cfg["expert_parallel"]["autoep_size"] = ep
    if tp > 1:
        cfg["tensor_parallel"] = TP_BLOCK
    engine, *_ = zerospeed.initialize(model=_model("mixtral", 2), config=cfg)
    batches = _batches(world // tp)
    rank = dist.get_rank(engine.group)
    if mode == "save":
        for ids in (b[rank] for b in batches[:2]):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        engine.save_checkpoint(ckpt, tag="t")
        engine.save_16bit_model(ckpt + "_hf")
    else:
        engine.load_checkpoint(ckpt, tag="t")
    ids = batches[2][rank]
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return float(loss.detach()), rank


@pytest.mark.parametrize("tp", [1, 2])
def test_autoep_checkpoint_and_16bit_model(tmp_path, tp):
    """Saved at ep 2 (ZeRO 2; tp 2: world 4, AutoTP over the attention): the checkpoint holds the whole Hugging
    Face tensors, so it resumes at ep 1 and tp 1 (world 2, every rank every expert) with the same next-step
    loss; save_16bit_model writes HF-named full weights that `from_pretrained` loads into a model equal to the
    trained one (its next-step loss is the run's)."""
    from safetensors.torch import load_file

    ckpt = str(tmp_path / "ckpt")
    saved = {r: loss for loss, r in run_distributed(_save_run, 2 * tp, ckpt, "save", 2, tp)}  # data rank -> loss
    resumed = {r: loss for loss, r in run_distributed(_save_run, 2, ckpt, "resume", 1)}
    for rank in range(2):
        assert resumed[rank] == pytest.approx(saved[rank], rel=1e-6), rank
    state = load_file(f"{ckpt}_hf/model.safetensors")
    model = _model("mixtral", 2)
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (E, 64, 16)
    assert set(state) == set(model.state_dict())
    model.config.save_pretrained(f"{ckpt}_hf")  # the user's config.json beside the weights
    hf = type(model).from_pretrained(f"{ckpt}_hf")
    ids = _batches(2)[2]
    for rank in range(2):
        assert float(hf(input_ids=ids[rank], labels=ids[rank]).loss.detach()) == pytest.approx(saved[rank], rel=1e-5)


def _engine_losses(rank: int, world: int, ep: int, stage: int, ga: int, bf16: bool):
    """Per-step losses of the tiny Mixtral through the engine with AutoEP at `ep` (1: disabled, every expert on
    every rank: the ordinary data-parallel path), `ga` micro-batches per step (rank r's micro-batch j of step s
    is batch s x ga + j of its stream)."""
    import zerospeed

    cfg = _config(stage)
    cfg.update(gradient_accumulation_steps=ga, expert_parallel={"enabled": ep > 1, "autoep_size": ep})
    if bf16:
        cfg["bf16"] = {"enabled": True}
    engine, *_ = zerospeed.initialize(model=_model("mixtral"), config=cfg)
    g = torch.Generator().manual_seed(11 + rank)
    losses = []
    for _ in range(STEPS * ga):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float()))
    return losses


@pytest.mark.parametrize("ga,bf16", [(2, False), (1, True)])
def test_autoep_with_accumulation_and_bf16_equals_data_parallel(ga, bf16):
    """ZeRO 2: AutoEP at ep 2 trains as the ordinary data-parallel engine holding every expert (fp32 with 2
    micro-batches per step: 1e-5; bf16: within bf16 rounding of one step, 1e-2)."""
    ep2 = run_distributed(_engine_losses, 2, 2, 2, ga, bf16)
    ep1 = run_distributed(_engine_losses, 2, 1, 2, ga, bf16)
    for rank in range(2):
        assert ep2[rank] == pytest.approx(ep1[rank], rel=1e-2 if bf16 else 1e-5), rank
