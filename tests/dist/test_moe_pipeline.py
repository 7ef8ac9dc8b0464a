"""Expert parallelism inside a pipeline (issue 25): a PipelineModule whose second stage holds an MoE layer with
ep_size 2, at pp 2 x dp 2 (world 4: each stage's two data replicas form its expert group), against plain
PyTorch on the whole model (every expert, ep 1) and the global batch: per-step losses and global gradient
norms equal to 1e-6 relative (AdamW with clipping at 0.1: the norm must count each stage and each expert
once), ZeRO 0 and 2, 1F1B and ZB-H1 (backward split into input- and weight-gradient passes). The routing is
dropless top-1 without random token selection, so a token's output does not depend on which micro-batch it
rides in. A checkpoint saved at ep 2 resumes at ep 1 with the same next-step loss."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerospeed
from zerospeed.pipe import LayerSpec, PipelineModule
from zerospeed.testing.parity import max_rel_diff
from zerospeed.testing.spawn import run_distributed

STEPS, MICRO, GAS, WIDTH, E = 4, 2, 4, 8, 4


class MoEOut(nn.Module):
    """An MoE layer (top-1, dropless) whose output replaces its input; the auxiliary loss is left out."""

    def __init__(self, dim: int, ep: int):
        from zerospeed.moe.layer import MoE

        super().__init__()
        self.moe = MoE(dim, nn.Linear(dim, dim), num_experts=E, ep_size=ep, k=1, use_rts=False, drop_tokens=False)

    def forward(self, x):
        return self.moe(x)[0]


def _module(ep: int, stages: int):
    layers = [LayerSpec(nn.Linear, WIDTH, 16), LayerSpec(nn.Tanh), LayerSpec(MoEOut, 16, ep), LayerSpec(nn.Linear, 16, 4)]
    return PipelineModule(layers, num_stages=stages, loss_fn=nn.MSELoss(), seed_layers=True,
                          partition_method="uniform", **({} if stages > 1 else {"stage_id": 0}))


def _data(dp: int):
    g = torch.Generator().manual_seed(7)
    n = (STEPS + 1) * GAS * MICRO * dp
    return torch.randn(n, WIDTH, generator=g), torch.randn(n, 4, generator=g)


def _rank_batches(dp: int, dp_rank: int):
    x, y = _data(dp)
    per_step, out = GAS * MICRO * dp, []
    for s in range(STEPS + 1):
        xs, ys = x[s * per_step:(s + 1) * per_step], y[s * per_step:(s + 1) * per_step]
        mine = slice(dp_rank * GAS * MICRO, (dp_rank + 1) * GAS * MICRO)
        out += list(zip(xs[mine].split(MICRO), ys[mine].split(MICRO)))
    return out


def _config(stage: int, schedule: str) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0}}, "gradient_clipping": 0.1,
            "zero_optimization": {"stage": stage}, "pipeline": {"schedule": schedule}}


def _global_state(engine) -> dict:
    """Parameters under global expert ids (local expert i of expert rank r: r x E/2 + i)."""
    out, ep = {}, engine.mesh.size("expert")
    for n, p in engine.module.named_parameters():
        if ".deepspeed_experts." in n and ep > 1:
            head, _, tail = n.partition(".deepspeed_experts.")
            i, _, rest = tail.partition(".")
            n = f"{head}.deepspeed_experts.{engine.mesh.rank('expert') * (E // ep) + int(i)}.{rest}"
        out[n] = p.detach().clone()
    return out


def _run(rank: int, world: int, cases):
    out = {}
    for stage, schedule in cases:
        engine, *_ = zerospeed.initialize(model=_module(2, 2), config=_config(stage, schedule))
        assert engine.mesh.size("expert") == 2 and engine.mesh.size("pipe") == 2
        it = iter(_rank_batches(engine.dp_world_size, dist.get_rank(engine.group)))
        losses, norms = [], []
        for _ in range(STEPS):
            losses.append(float(engine.train_batch(it)))
            norms.append(engine.get_global_grad_norm())
        out[(stage, schedule)] = losses, norms, _global_state(engine)
        engine.destroy()
    return out


def _reference():
    module = _module(1, 1)
    opt = torch.optim.AdamW(module.parameters(), lr=3e-3, weight_decay=0.0)
    x, y = _data(2)
    per_step, losses, norms = GAS * MICRO * 2, [], []
    for s in range(STEPS):
        loss = nn.functional.mse_loss(module(x[s * per_step:(s + 1) * per_step]), y[s * per_step:(s + 1) * per_step])
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(module.parameters(), 0.1)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, {n: p.detach() for n, p in module.named_parameters()}


CASES = [(0, "1f1b"), (2, "1f1b"), (0, "zb_h1"), (2, "zb_h1")]


def test_expert_parallel_in_a_pipeline_matches_one_process():
    ref_losses, ref_norms, ref_state = _reference()
    assert min(ref_norms) > 0.1  # clipping active every step
    for rank, res in enumerate(run_distributed(_run, 4, CASES, timeout=300)):
        for case in CASES:
            losses, norms, state = res[case]
            assert max_rel_diff(losses, ref_losses) < 1e-6, (case, rank, losses, ref_losses)
            assert max_rel_diff(norms, ref_norms) < 1e-6, (case, rank, norms, ref_norms)
            assert state
            for n, p in state.items():
                torch.testing.assert_close(p, ref_state[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{case} {rank} {n} {m}")


def _ckpt_run(rank: int, world: int, ep: int, mode: str, ckpt: str):
    """"save": 2 steps, save (checkpoint and 16-bit model), a 3rd; "resume": load, save the 16-bit model, the
    3rd. Returns the 3rd step's loss."""
    engine, *_ = zerospeed.initialize(model=_module(ep, 2), config=_config(2, "1f1b"))
    batches = _rank_batches(engine.dp_world_size, dist.get_rank(engine.group))
    if mode == "save":
        it = iter(batches)
        for _ in range(2):
            engine.train_batch(it)
        engine.save_checkpoint(ckpt, tag="t")
    else:
        engine.load_checkpoint(ckpt, tag="t")
    engine.save_16bit_model(f"{ckpt}_16bit_ep{ep}")  # every stage's layers, every expert under its global id
    return float(engine.train_batch(iter(batches[2 * GAS:])))


def test_pipeline_expert_checkpoint_resumes_at_ep_1(tmp_path):
    """Saved at pp 2 x dp 2 with ep 2, resumed at ep 1 (every expert on every rank): the same next-step loss; and
    the two 16-bit files of the same weights (ep 2 gathers each stage's experts over its expert group) are the
    same bytes, keyed as the one-stage module at ep 1."""
    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(_ckpt_run, 4, 2, "save", ckpt)
    resumed = run_distributed(_ckpt_run, 4, 1, "resume", ckpt)
    assert resumed == pytest.approx(saved, rel=1e-6)
    files = [tmp_path / f"ckpt_16bit_ep{ep}" / "model.safetensors" for ep in (2, 1)]
    assert files[0].read_bytes() == files[1].read_bytes()
    from safetensors.torch import load_file

    saved16 = load_file(str(files[0]))
    assert list(saved16) == list(_module(1, 1).state_dict())  # every expert of the E, in the module's order
    assert sum(".deepspeed_experts." in k for k in saved16) == 2 * E
