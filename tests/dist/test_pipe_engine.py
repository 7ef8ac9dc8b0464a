"""The pipeline engine on real gloo ranks against one process: a PipelineModule of 6 Linear/Tanh layers
(LayerSpecs, seed_layers) at pp 2 (world 2) and pp 2 x dp 2 (world 4), every schedule the engine runs (1F1B,
GPipe, ZB-H1 with its backward split into input- and weight-gradient passes), ZeRO 0, 1 and 2 (beyond
DeepSpeed), SGD without clipping (a wrong gradient scale shows) and AdamW with clipping at 0.5 (the norm must
cover every stage), 4 micro-batches: per-step losses and norms equal plain PyTorch on the whole model and
global batch to 1e-6 relative, and each stage's final weights equal the same layers' to 1e-5. The same for a
weight tied between the first and last stage (TiedLayerSpec) and for a tuple activation with an integer mask.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerospeed
from zerospeed.config import ConfigError
from zerospeed.pipe import DualPipeVModule, LayerSpec, PipelineModule, TiedLayerSpec
from zerospeed.testing.models import ApplyMask, WithMask
from zerospeed.testing.parity import max_rel_diff
from zerospeed.testing.spawn import RankFailure, run_distributed

STEPS, MICRO, GAS, WIDTH = 6, 2, 4, 16
OPTIMIZERS = {"sgd": ({"type": "SGD", "params": {"lr": 0.1}}, 0.0),
              "adamw-clip": ({"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0}}, 0.5)}


def _head(module, x):
    """The tied input layer used as the output head (the transposed weight, as a language model's lm_head)."""
    return x @ module.weight


def _layers(kind="plain"):
    if kind == "tuple":  # the (hidden, mask) tuple crosses from stage 0 to stage 1
        return [LayerSpec(nn.Linear, WIDTH, 32), LayerSpec(WithMask), LayerSpec(ApplyMask, 32), LayerSpec(nn.Linear, 32, 4)]
    if kind == "tied":  # WIDTH -> 32 -> ... -> 32 -> WIDTH through the same weight at both ends (first and last stage)
        return [TiedLayerSpec("embed", nn.Linear, WIDTH, 32, bias=False), LayerSpec(nn.Tanh),
                LayerSpec(nn.Linear, 32, 32), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 32, 32),
                TiedLayerSpec("embed", nn.Linear, WIDTH, 32, bias=False, forward_fn=_head)]
    return [LayerSpec(nn.Linear, WIDTH, 32), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 32, 32), LayerSpec(nn.Tanh),
            LayerSpec(nn.Linear, 32, 32), LayerSpec(nn.Linear, 32, 4)]


def _data(dp, kind="plain"):
    g = torch.Generator().manual_seed(7)
    n = STEPS * GAS * MICRO * dp
    return torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH if kind == "tied" else 4, generator=g)


def _rank_batches(x, y, dp, dp_rank):
    """This data-parallel rank's micro-batches, step after step: rows of each global batch split by rank."""
    out = []
    per_step = GAS * MICRO * dp
    for s in range(STEPS):
        xs, ys = x[s * per_step:(s + 1) * per_step], y[s * per_step:(s + 1) * per_step]
        mine = slice(dp_rank * GAS * MICRO, (dp_rank + 1) * GAS * MICRO)
        out += list(zip(xs[mine].split(MICRO), ys[mine].split(MICRO)))
    return out


LAYOUTS = {"interleaved_1f1b": {"chunks": 2}, "zb_v": {"chunks": 2, "chunk_layout": "v"},
           "dualpipev": {"chunks": 2, "chunk_layout": "v"}}  # the others: one chunk


def pipe_runs(rank, world, cases, kind="plain"):
    out = {}
    for case, stage, opt in cases:
        schedule, fused = case.removesuffix(":fused"), case.endswith(":fused")  # ":fused": autograd's backward
        block, clip = OPTIMIZERS[opt]
        module = PipelineModule(_layers("plain" if kind == "ckpt" else kind), num_stages=2, loss_fn=nn.MSELoss(),
                                seed_layers=True, partition_method="uniform", **LAYOUTS.get(schedule, {}),
                                activation_checkpoint_interval=2 if kind == "ckpt" else 0)
        engine, *_ = zerospeed.initialize(model=module, config={
            "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "optimizer": block,
            "gradient_clipping": clip, "zero_optimization": {"stage": stage},
            "pipeline": {"schedule": schedule, **({"split_backward": False} if fused else {})}})
        assert engine.schedule_name == schedule
        # "split_backward": "auto" splits every backward in fp32 at ZeRO 0-1 without checkpointing; the zero-bubble
        # schedules split their BackwardInput pairs whatever it says (their fused Backwards follow it)
        assert engine._split_all == (not fused and kind != "ckpt" and stage <= 1)
        # ... and without split_backward a B followed at once by its W runs fused (ZB-H1's first stage: all)
        first_fused = schedule == "zb_h1" and engine.stage_id == 0 and not engine._split_all
        assert bool(engine._split_keys) == (schedule in ("zb_h1", "zb_v", "dualpipev") and not first_fused)
        dp, dp_rank = engine.dp_world_size, dist.get_rank(engine.group)
        it = iter(_rank_batches(*_data(dp, kind), dp, dp_rank))
        losses, norms = [], []
        for _ in range(STEPS):
            losses.append(float(engine.train_batch(it)))
            norms.append(engine.get_global_grad_norm())
        out[(case, stage, opt)] = {"losses": losses, "norms": norms, "dp": dp,
                             "state": {n: p.detach().clone() for n, p in module.named_parameters()}}
        engine.destroy()
    return out


def reference(opt, dp, kind="plain"):
    block, clip = OPTIMIZERS[opt]
    module = PipelineModule(_layers(kind), num_stages=1, loss_fn=nn.MSELoss(), seed_layers=True,
                            partition_method="uniform", stage_id=0)
    cls = torch.optim.SGD if block["type"] == "SGD" else torch.optim.AdamW
    optim = cls(module.parameters(), **block["params"])
    x, y = _data(dp, kind)
    per_step = GAS * MICRO * dp
    losses, norms = [], []
    for s in range(STEPS):
        xs, ys = x[s * per_step:(s + 1) * per_step], y[s * per_step:(s + 1) * per_step]
        loss = nn.functional.mse_loss(module(xs), ys)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(module.parameters(), clip if clip > 0 else float("inf"))))
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, norms, {n: p.detach() for n, p in module.named_parameters()}


SCHEDULES = ("1f1b", "gpipe", "zb_h1", "interleaved_1f1b", "zb_v", "dualpipev")
# in fp32 at ZeRO 0-1 every backward runs split into its input- and weight-gradient passes by default
# ("split_backward": "auto"); "1f1b:fused" is 1F1B with autograd's fused backward ("split_backward": false)
CASES = [(schedule, stage, opt) for schedule in SCHEDULES + ("1f1b:fused",) for stage in (0, 1, 2)
         for opt in OPTIMIZERS]


@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_schedules_match_one_process(world):
    """Every schedule (zb_h1: backward split into input- and weight-gradient passes; the others run each
    backward's two passes back to back at ZeRO 0-1, fused at 2; 1F1B also fused throughout) x ZeRO 0-2 x
    optimizer."""
    results = run_distributed(pipe_runs, world, CASES, timeout=300)
    for (schedule, stage, opt) in CASES:
        ref_losses, ref_norms, ref_state = reference(opt, world // 2)
        for rank, res in enumerate(results):
            r = res[(schedule, stage, opt)]
            assert r["dp"] == world // 2
            assert max_rel_diff(r["losses"], ref_losses) < 1e-6, (world, schedule, stage, opt, rank, r["losses"], ref_losses)
            assert max_rel_diff(r["norms"], ref_norms) < 1e-6, (world, schedule, stage, opt, rank, r["norms"], ref_norms)
            assert r["state"], "the stage holds no parameters"
            _check_weights(r["state"], ref_state, (world, schedule, stage, opt, rank))


def _check_weights(state, ref_state, where):
    for name, value in state.items():
        want = ref_state[name]
        err = float((value - want).abs().max() / want.abs().max())
        assert err < 1e-5, (*where, name, err)


TIED_CASES = [(schedule, stage, opt) for schedule in ("1f1b", "zb_h1", "interleaved_1f1b", "zb_v", "dualpipev")
              for stage in (0, 1, 2) for opt in OPTIMIZERS]


@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_tied_layers_match_one_process(world):
    """A weight tied between the first and the last stage (input layer and output head): the copies start equal
    (stage 1 built its own from another seed), their gradients are summed over both stages after the
    data-parallel reduction, and the global norm counts the weight once; under ZB-V one rank holds both ends."""
    results = run_distributed(pipe_runs, world, TIED_CASES, "tied", timeout=300)
    for (schedule, stage, opt) in TIED_CASES:
        ref_losses, ref_norms, ref_state = reference(opt, world // 2, "tied")
        for rank, res in enumerate(results):
            r = res[(schedule, stage, opt)]
            assert max_rel_diff(r["losses"], ref_losses) < 1e-6, (world, schedule, stage, opt, rank, r["losses"])
            assert max_rel_diff(r["norms"], ref_norms) < 1e-6, (world, schedule, stage, opt, rank, r["norms"])
            _check_weights(r["state"], ref_state, (world, schedule, stage, opt, rank))
        # the tie spans two ranks, except under ZB-V, where rank 0 holds the first and the last stage alike
        holders = [rank for rank, res in enumerate(results) if "tied_modules.embed.weight" in res[(schedule, stage, opt)]["state"]]
        assert len(holders) == (world // 2 if schedule in ("zb_v", "dualpipev") else world), (schedule, holders)


TUPLE_CASES = [(schedule, 1, "adamw-clip") for schedule in SCHEDULES]


def test_pipeline_tuple_activations_match_one_process():
    """A (hidden, integer mask) tuple between the stages: both tensors arrive, only the hidden one has a
    gradient sent back."""
    results = run_distributed(pipe_runs, 2, TUPLE_CASES, "tuple", timeout=300)
    ref_losses, ref_norms, ref_state = reference("adamw-clip", 1, "tuple")
    for case in TUPLE_CASES:
        for rank, res in enumerate(results):
            r = res[case]
            assert max_rel_diff(r["losses"], ref_losses) < 1e-6, (case, rank, r["losses"], ref_losses)
            assert max_rel_diff(r["norms"], ref_norms) < 1e-6, (case, rank)
            _check_weights(r["state"], ref_state, (case, rank))


CKPT_CASES = [(schedule, 2, "sgd") for schedule in SCHEDULES]


def test_pipeline_activation_checkpointing_matches_one_process():
    """activation_checkpoint_interval=2 (non-reentrant torch.utils.checkpoint): the recomputed forward gives
    the same training under every schedule, the zero-bubble split included (its passes backward through a
    checkpointed block twice)."""
    results = run_distributed(pipe_runs, 2, CKPT_CASES, "ckpt", timeout=300)
    ref_losses, ref_norms, ref_state = reference("sgd", 1)
    for case in CKPT_CASES:
        for rank, res in enumerate(results):
            r = res[case]
            assert max_rel_diff(r["losses"], ref_losses) < 1e-6 and max_rel_diff(r["norms"], ref_norms) < 1e-6, case
            _check_weights(r["state"], ref_state, (case, rank))


def dualpipev_module_run(rank, world):
    module = DualPipeVModule(_layers("tied"), num_stages=2, loss_fn=nn.MSELoss(), seed_layers=True,
                             partition_method="uniform")
    engine, *_ = zerospeed.initialize(model=module, config={  # no pipeline block: DeepSpeed's DualPipeVEngine
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
        "optimizer": OPTIMIZERS["adamw-clip"][0], "gradient_clipping": 0.5, "zero_optimization": {"stage": 1}})
    dp = engine.dp_world_size
    it = iter(_rank_batches(*_data(dp, "tied"), dp, dist.get_rank(engine.group)))
    losses = [float(engine.train_batch(it)) for _ in range(STEPS)]
    return {"schedule": engine.schedule_name, "owners": [module.stage_owner(i) for i in range(6)], "losses": losses,
            "first_last": (engine.is_first_stage(), engine.is_last_stage()),
            "state": {n: p.detach().clone() for n, p in module.named_parameters()}}


@pytest.mark.parametrize("world", [2, 4])
def test_dualpipev_module_runs_dualpipev_by_default(world):
    """DeepSpeed's DualPipeVModule: rank r holds model stages r and 3 - r (stage_owner gives the rank, as
    DeepSpeed's), rank 0 the first and last (the tied embedding/head is one module there), and without a
    pipeline block it runs DualPipeV; losses and weights equal one process."""
    ref_losses, _, ref_state = reference("adamw-clip", world // 2, "tied")
    for rank, r in enumerate(run_distributed(dualpipev_module_run, world, timeout=300)):
        assert r["schedule"] == "dualpipev"
        assert r["owners"] == [0, 0, 1, 1, 1, 0]  # 6 layers in 4 stages of [2, 2, 1, 1], on ranks 0, 1, 1, 0
        assert r["first_last"] == ((True, True) if rank // (world // 2) == 0 else (False, False))
        assert max_rel_diff(r["losses"], ref_losses) < 1e-6, (rank, r["losses"], ref_losses)
        _check_weights(r["state"], ref_state, (world, rank))


def misuse(rank, world):
    module = PipelineModule(_layers(), num_stages=2, loss_fn=nn.MSELoss(), seed_layers=True)
    engine, *_ = zerospeed.initialize(model=module, config={"train_micro_batch_size_per_gpu": MICRO,
                                                            "gradient_accumulation_steps": GAS,
                                                            "optimizer": OPTIMIZERS["sgd"][0]})
    with pytest.raises(RuntimeError, match="train_batch"):
        engine(torch.zeros(MICRO, WIDTH))
    dry = iter(_rank_batches(*_data(1), 1, 0)[:2])  # 2 of the 4 micro-batches: both stages read data here
    with pytest.raises(RuntimeError, match="ran dry at micro-batch 2 of 4"):
        engine.train_batch(dry)  # raised before any message, so no stage is left waiting
    base = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": GAS}
    with pytest.raises(ConfigError, match="chunks=2 and chunk_layout='v'"):  # before any group or tensor
        zerospeed.initialize(model=PipelineModule(_layers(), num_stages=2, loss_fn=nn.MSELoss()),
                             config={**base, "pipeline": {"schedule": "zb_v"}})
    with pytest.raises(ConfigError, match="needs num_microbatches a multiple of num_stages"):
        zerospeed.initialize(model=PipelineModule(_layers(), num_stages=2, loss_fn=nn.MSELoss(), chunks=2),
                             config={**base, "gradient_accumulation_steps": 3, "pipeline": {"schedule": "interleaved_1f1b"}})
    with pytest.raises(ConfigError, match="DualPipeV needs at least 2 x num_stages = 4 micro-batches, got 3"):
        zerospeed.initialize(model=DualPipeVModule(_layers(), num_stages=2, loss_fn=nn.MSELoss()),
                             config={**base, "gradient_accumulation_steps": 3})
    with pytest.raises(ConfigError, match="not a zerospeed.pipe.PipelineModule"):
        zerospeed.initialize(model=nn.Linear(2, 2), config={**base, "pipeline": {"schedule": "gpipe"}})
    with pytest.raises(ConfigError, match="pipeline.stages=4 but the PipelineModule has num_stages=2"):
        zerospeed.initialize(model=PipelineModule(_layers(), num_stages=2, loss_fn=nn.MSELoss()),
                             config={**base, "pipeline": {"stages": 4}})
    with pytest.raises(NotImplementedError, match="stage=3 with a PipelineModule"):
        zerospeed.initialize(model=PipelineModule(_layers(), num_stages=2, loss_fn=nn.MSELoss()),
                             config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})
    return True


def mismatched_shapes(rank, world):
    module = PipelineModule(_layers(), num_stages=2, loss_fn=nn.MSELoss(), seed_layers=True)
    engine, *_ = zerospeed.initialize(model=module, config={"train_micro_batch_size_per_gpu": MICRO,
                                                            "gradient_accumulation_steps": GAS,
                                                            "optimizer": OPTIMIZERS["sgd"][0]})
    batches = _rank_batches(*_data(1), 1, 0)[:GAS]
    batches[1] = (batches[1][0][:1], batches[1][1][:1])  # a short micro-batch in the middle
    engine.train_batch(iter(batches))


def test_pipeline_mismatched_activation_shapes_are_named_not_hung():
    """A micro-batch of another shape: the sending stage raises naming itself and both shapes; its neighbour,
    blocked in a receive, is stopped (no hang)."""
    with pytest.raises(RankFailure, match=r"pipeline stage 0 produced an activation \[1, 32\] torch.float32, but "
                                          r"earlier micro-batches had \[2, 32\] torch.float32.*dynamic_shape=True"):
        run_distributed(mismatched_shapes, 2, timeout=60)


def dynamic_run(rank, world, num_stages, schedule):
    module = PipelineModule(_layers(), num_stages=num_stages, loss_fn=nn.MSELoss(), seed_layers=True,
                            dynamic_shape=True)
    engine, *_ = zerospeed.initialize(model=module, config={
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
        "optimizer": OPTIMIZERS["sgd"][0], "pipeline": {"schedule": schedule}})
    batches = _rank_batches(*_data(1), 1, 0)
    for i in range(1, len(batches), 3):  # every third micro-batch one row short
        batches[i] = (batches[i][0][:1], batches[i][1][:1])
    it = iter(batches)
    return [float(engine.train_batch(it)) for _ in range(STEPS)]


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_pipeline_dynamic_shape_takes_micro_batches_of_other_sizes(schedule):
    """PipelineModule(dynamic_shape=True), DeepSpeed's flag: micro-batches of 2 and 1 rows mixed; the losses equal
    a one-stage run's on the same micro-batches."""
    one = run_distributed(dynamic_run, 1, 1, "1f1b", timeout=120)[0]
    for losses in run_distributed(dynamic_run, 2, 2, schedule, timeout=120):
        assert max_rel_diff(losses, one) < 1e-6, (losses, one)


def ahead_run(rank, world):
    module = PipelineModule(_layers(), num_stages=2, loss_fn=nn.MSELoss(), seed_layers=True)
    engine, *_ = zerospeed.initialize(model=module, config={"train_micro_batch_size_per_gpu": MICRO,
                                                            "gradient_accumulation_steps": GAS,
                                                            "optimizer": OPTIMIZERS["sgd"][0]})
    it = iter(_rank_batches(*_data(1), 1, 0))
    for _ in range(STEPS):
        engine.train_batch(it)
    return engine._link.received_ahead


def test_pipeline_receives_are_posted_ahead():
    """1F1B at pp 2: each message is received through a receive posted before the computation ahead of it: stage
    0's 4 gradients per batch, and stage 1's activations but the batch's first (nothing runs before it)."""
    assert run_distributed(ahead_run, 2, timeout=120) == [STEPS * GAS, STEPS * (GAS - 1)]


def test_pipeline_misuse_errors():
    assert run_distributed(misuse, 2, timeout=120) == [True, True]


def checkpoint_round_trip(rank, world, save_dir):
    def engine():
        module = PipelineModule(_layers(), num_stages=2, loss_fn=nn.MSELoss(), seed_layers=True)
        return zerospeed.initialize(model=module, config={
            "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "optimizer": OPTIMIZERS["adamw-clip"][0], "zero_optimization": {"stage": 1}})[0]

    batches = _rank_batches(*_data(1), 1, 0)
    a = engine()
    a.train_batch(iter(batches[:GAS]))
    a.save_checkpoint(save_dir, tag="t")
    kept = float(a.train_batch(iter(batches[GAS:2 * GAS])))
    b = engine()
    b.load_checkpoint(save_dir, tag="t")
    return kept, float(b.train_batch(iter(batches[GAS:2 * GAS])))


def test_pipeline_checkpoint_resumes_at_the_same_stages(tmp_path):
    for kept, resumed in run_distributed(checkpoint_round_trip, 2, str(tmp_path), timeout=120):
        assert resumed == kept


def bf16_run(rank, world):
    module = PipelineModule(_layers(), num_stages=2, loss_fn=nn.MSELoss(), seed_layers=True)
    engine, *_ = zerospeed.initialize(model=module, config={
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "bf16": {"enabled": True},
        "optimizer": OPTIMIZERS["adamw-clip"][0], "gradient_clipping": 0.5, "zero_optimization": {"stage": 1}})
    it = iter([(x.bfloat16(), y.bfloat16()) for x, y in _rank_batches(*_data(1), 1, 0)])
    return [float(engine.train_batch(it)) for _ in range(STEPS)]


def test_pipeline_bf16_activations():
    ref_losses, _, _ = reference("adamw-clip", 1)
    for losses in run_distributed(bf16_run, 2, timeout=120):
        assert max_rel_diff(losses, ref_losses) < 3e-2  # bf16 parameters and activations, fp32 masters


def eval_runs(rank, world, schedule):
    module = PipelineModule(_layers(), num_stages=2, loss_fn=nn.MSELoss(), seed_layers=True,
                            partition_method="uniform", **LAYOUTS.get(schedule, {}))
    engine, *_ = zerospeed.initialize(model=module, config={
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
        "optimizer": OPTIMIZERS["sgd"][0], "pipeline": {"schedule": schedule}})
    dp, dp_rank = engine.dp_world_size, dist.get_rank(engine.group)
    batches = _rank_batches(*_data(dp), dp, dp_rank)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    avg = engine.eval_batch(iter(batches))
    listed, logits = engine.eval_batch(iter(batches), reduce_output=None, return_logits=True, bcast_loss=False)
    two = engine.eval_batch(iter(batches), num_micro_batches=2)
    unchanged = all(torch.equal(p, before[n]) for n, p in module.named_parameters())
    no_grads = all(p.grad is None for p in module.parameters())
    trained = float(engine.train_batch(iter(batches)))  # training continues after evaluation
    return {"avg": float(avg), "two": float(two), "listed": None if listed is None else [float(v) for v in listed],
            "logits": None if logits is None else logits.shape, "unchanged": unchanged, "no_grads": no_grads,
            "dp": dp, "trained": trained, "last": engine.is_last_stage()}


@pytest.mark.parametrize("world,schedule", [(2, "1f1b"), (2, "zb_v"), (4, "interleaved_1f1b")])
def test_eval_batch_matches_one_process(world, schedule):
    """eval_batch (DeepSpeed's arguments): the mean loss over micro-batches and data ranks on every stage, the
    per-micro-batch list and the last output on the last stage, fewer micro-batches, no weight or gradient
    touched; train_batch afterwards gives the first training loss."""
    results = run_distributed(eval_runs, world, schedule, timeout=300)
    dp = world // 2
    full = PipelineModule(_layers(), num_stages=1, loss_fn=nn.MSELoss(), seed_layers=True, stage_id=0)
    x, y = _data(dp)
    ref_losses, _, _ = reference("sgd", dp)
    with torch.no_grad():  # micro-batch losses of the first global batch, data rank by data rank
        per = [[float(nn.functional.mse_loss(full(xb), yb)) for xb, yb in _rank_batches(x, y, dp, d)[:GAS]]
               for d in range(dp)]
    want = sum(sum(p) / GAS for p in per) / dp
    want_two = sum(sum(p[:2]) / 2 for p in per) / dp
    for rank, r in enumerate(results):
        assert abs(r["avg"] - want) < 1e-6 * abs(want) and abs(r["two"] - want_two) < 1e-6 * abs(want_two), (rank, r)
        assert r["unchanged"] and r["no_grads"], rank
        assert abs(r["trained"] - ref_losses[0]) < 1e-6 * abs(ref_losses[0]), (rank, r["trained"], ref_losses[0])
        if r["last"]:
            d = rank % dp
            assert max_rel_diff(r["listed"], per[d]) < 1e-6 and r["logits"] == (MICRO, 4), (rank, r)
        else:
            assert r["listed"] is None and r["logits"] is None


def fp16_run(rank, world, num_stages, schedule):
    module = PipelineModule(_layers(), num_stages=num_stages, loss_fn=nn.MSELoss(), seed_layers=True,
                            partition_method="uniform", **LAYOUTS.get(schedule, {}))
    engine, *_ = zerospeed.initialize(model=module, config={
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": 0.5,
        "fp16": {"enabled": True, "initial_scale_power": 17, "loss_scale_window": 2, "hysteresis": 1},
        "optimizer": OPTIMIZERS["adamw-clip"][0], "zero_optimization": {"stage": 1}, "pipeline": {"schedule": schedule}})
    it = iter([(x.half(), y.half()) for x, y in _rank_batches(*_data(1), 1, 0)])
    out = []
    for _ in range(STEPS):
        loss = float(engine.train_batch(it))
        out.append((loss, engine.skipped_steps, engine.loss_scaler.loss_scale))
    return out


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1", "zb_v"])
def test_pipeline_fp16_loss_scaling_matches_one_stage(schedule):
    """fp16 with dynamic loss scaling from 2^17: the first two steps overflow, the scale halves, trains, doubles
    after loss_scale_window=2 good steps and overflows again; every stage skips the same steps together (the
    overflow decided over the world) and skips and scales equal a one-stage run's exactly, losses too for 1F1B
    (fused backward in fp16); with the split (zb_h1, zb_v) a linear layer's weight gradient accumulates over
    micro-batches in one GEMM (`addmm_`: one fp16 rounding, not two), so its losses equal to 1e-3 relative."""
    one = run_distributed(fp16_run, 1, 1, "1f1b", timeout=300)[0]
    for got in run_distributed(fp16_run, 2, 2, schedule, timeout=300):
        assert [g[1:] for g in got] == [o[1:] for o in one], (schedule, got, one)
        tol = 0 if schedule == "1f1b" else 1e-3
        assert all(abs(g[0] - o[0]) <= tol * abs(o[0]) for g, o in zip(got, one)), (schedule, got, one)
    assert [(skipped, scale) for _, skipped, scale in one] == [(1, 2 ** 16), (2, 2 ** 15), (2, 2 ** 15), (2, 2 ** 15),
                                                              (2, 2 ** 16), (3, 2 ** 15)], one
    ref_losses, _, _ = reference("adamw-clip", 1)
    assert abs(one[0][0] - ref_losses[0]) < 2e-3 * ref_losses[0]  # the same model in fp16 (before any step)
