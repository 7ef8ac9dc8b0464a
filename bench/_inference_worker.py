"""One configuration of bench_inference.py (issue 26): one system serving one GPT-2 at one batch size. Started by
`bench_inference.py` (not a user entry point): plain `python` for world 1, torchrun for the tp 2 systems.

    python bench/_inference_worker.py --system zs-fp32 --model 124m --batch 1 --prompt 128 --new-tokens 256 \
        --inner 2 --result out.json
    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/_inference_worker.py --system zs-tp2-fp32 ...

The model: `transformers.GPT2LMHeadModel` built from its config after `torch.manual_seed(seed)` (random init, no
download), `.eval()`. The system wraps it (`wrap`), then, in this order:

1. warm-up: one `generate` with the measured shapes (kernel injection compiles its decode step here);
2. prefill (TTFT): median of `PREFILL_SAMPLES` (5) `generate(max_new_tokens=1)` calls - what a user waits for the
   first token, through each system's own path (kernel injection: its static cache, kept from the warm-up at the
   longer length, so no recompile; the one-token generate never runs the compiled decode step);
3. `--inner` timed `generate(max_new_tokens=N, eos_token_id=None)` calls, greedy, pad_token_id 0, attention mask of
   ones: exactly N tokens each (no end-of-sequence token stops them; since session 24 - before, `min_new_tokens=N`,
   whose logits processor added ~0.85 ms per token, an `isin` over the vocabulary, to every system), each between two
   read probes (rank 0, `read_probe`, 3 trials): the bound under the conditions of that very minute. Since session
   26 the probe's buffer is on 2 MiB huge pages (as the compiled decode step's weights): the machine's read rate
   without 4 KiB page walks; the 4 KiB-page probe is kept beside it (`gen_read_gbs_4k`).

Rank 0 writes one JSON object: status, the times, weight bytes and peak RSS (VmHWM) of every rank, the generated
token ids of the last call, and the read bandwidth before and after each timed generate (`gen_read_gbs`, inner + 1
values; the probe's 512 MiB buffer is freed and the peak RSS reset after each, `reset_peak_rss`, so VmHWM is the
serving's own); at tp 2, the collectives of one decode step, counted (`collectives_per_token`) and timed alone
(`collective_s`): what tensor parallelism adds per token on this machine. `measure_bandwidth` (run by the parent
in a `python -c` process of its own) gives the machine's read bandwidth and the eager fp32 GEMV rate over GPT-2's
weight shapes.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

_T_PROCESS = time.time()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

VOCAB = 50257  # GPT2Config()'s
# name -> GPT2Config keyword arguments (124m is GPT2Config()'s defaults, spelt out for measure_bandwidth)
MODELS = {"124m": dict(n_embd=768, n_layer=12, n_head=12), "350m": dict(n_embd=1024, n_layer=24, n_head=16)}
# system -> (kind, dtype, kernel injection (True, False or "nofreeze": set_empty_params=True), tp size)
SYSTEMS = {
    "hf-fp32": ("hf", "fp32", False, 1),
    "hf-bf16": ("hf", "bf16", False, 1),
    "zs-fp32": ("zs", "fp32", True, 1),
    "zs-bf16": ("zs", "bf16", True, 1),
    "zs-int8": ("zs", "int8", True, 1),
    "zs-fp32-noinject": ("zs", "fp32", False, 1),
    "zs-fp32-nofreeze": ("zs", "fp32", "nofreeze", 1),
    "zs-fp32-compile": ("zs", "fp32", "compile", 1),  # injection, ZEROSPEED_AOT_DECODE=0 (since session 36)
    "zs-tp2-fp32": ("zs", "fp32", True, 2),
    "zs-tp2-bf16": ("zs", "bf16", True, 2),
    "deepspeed-fp32": ("deepspeed", "fp32", False, 1),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}
PREFILL_SAMPLES = 5  # generate(max_new_tokens=1) calls per launch for the time to first token (median)
PROBE_HUGE_PAGES = None  # whether read_probe's buffer was on huge pages (False: the OS refused)
BRACKET_TRIALS = 3   # timed x.sum() calls of each read probe around a timed generate


def vm_hwm_bytes() -> int:
    """Peak resident set size of this process (VmHWM of /proc/self/status; ru_maxrss where that is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def build_model(model: str, seed: int):
    import transformers

    torch.manual_seed(seed)
    net = transformers.GPT2LMHeadModel(transformers.GPT2Config(**MODELS[model])).eval()
    assert net.config.vocab_size == VOCAB, net.config.vocab_size
    return net


def wrap(system: str, net):
    """(the object to keep alive, the HF module to call) for `system`."""
    kind, dtype, inject, tp = SYSTEMS[system]
    if kind == "hf":
        if dtype != "fp32":
            net.to(DTYPES[dtype])
        return net, net
    if kind == "zs":
        import zerospeed

        kw = {"dtype": DTYPES[dtype], "replace_with_kernel_inject": bool(inject),
              "set_empty_params": inject == "nofreeze"}
        if inject == "compile":  # the torch.compile decode step, not the AOTInductor package (read at build)
            os.environ["ZEROSPEED_AOT_DECODE"] = "0"
        if tp > 1:
            kw["tensor_parallel"] = {"tp_size": tp}
        engine = zerospeed.init_inference(net, **kw)
        return engine, engine.module
    import logging

    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    engine = deepspeed.init_inference(net, dtype=DTYPES[dtype], replace_with_kernel_inject=False)
    return engine, engine.module


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def collectives_per_token(module, batch: int) -> dict:
    """{op name: calls} of the collectives one decode step issues: counted (`TorchDispatchMode`, c10d and functional
    collective ops, waits excluded, and `comm.traced`'s point-to-point ops) in one eager forward of one token per
    sequence without a cache - the same layers as a decode step. Every rank of the group runs it (they are collective)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    calls: Counter = Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name.split("::")[-1]
            if func.namespace in ("c10d", "_c10d_functional") and not name.startswith("_") and "wait" not in name:
                calls[name] += 1
            elif func.namespace == "zerospeed" and name.startswith("message_"):  # comm.traced's, on gloo
                calls[name] += 1
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Count():
        module(torch.zeros(batch, 1, dtype=torch.long), use_cache=False)
    return dict(calls)


def collective_seconds(group, batch: int, d: int, vocab: int, blocks: int = 10, calls: int = 40) -> dict:
    """Seconds per call of a decode step's collectives on `group`, eager (the step's own, `comm.traced`: on gloo
    point-to-point messages since session 25, `torch.distributed`'s collectives before; this launch's threads):
    the all-reduce of one token's hidden states [batch, d] and the all-gather of the logits' shards
    [batch, vocab / world] fp32; the fastest of `blocks` blocks of `calls` back-to-back calls after a barrier
    (gloo's latency here moves 0.5-1.9 ms per call between blocks: the fastest gives the most optimistic limit)."""
    import torch.distributed as dist

    from zerospeed.comm.traced import traced_all_gather, traced_all_reduce

    world = dist.get_world_size(group)
    x = torch.zeros(batch, d)
    shard = torch.zeros(batch, -(-vocab // world))
    ops = {"all_reduce": lambda: traced_all_reduce(x, group), "all_gather": lambda: traced_all_gather(shard, group)}
    result = {}
    for name, op in ops.items():
        for _ in range(5):
            op()
        per_block = []
        for _ in range(blocks):
            dist.barrier(group=group)
            t = time.perf_counter()
            for _ in range(calls):
                op()
            per_block.append((time.perf_counter() - t) / calls)
        result[name] = min(per_block)
    return result


class InStepCollectives:
    """A context, entered around each timed `generate` at tp 2: the wall seconds this rank spends inside the
    decode step's collectives (`comm.traced`'s point-to-point exchanges on gloo, wrapped for the duration; the
    compiled step calls them through its custom ops, which look the function up per call), appended per
    generate to `seconds` (and the calls to `calls`). Unlike `collective_seconds` (each op timed alone,
    back to back), this includes what the step's own conditions add: the wait for the other rank (which reaches
    the exchange later) and the wake-ups of each rank's gloo threads between kernels that fill both cores."""

    def __init__(self):
        self.seconds: list[float] = []
        self.calls: list[int] = []

    def __enter__(self):
        from zerospeed.comm import traced

        self._module, self._orig = traced, traced._exchange
        self.seconds.append(0.0)
        self.calls.append(0)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return self._orig(*a, **k)
            finally:
                self.seconds[-1] += time.perf_counter() - t
                self.calls[-1] += 1

        traced._exchange = timed
        return self

    def __exit__(self, *exc):
        self._module._exchange = self._orig
        return False


def run(args, world: int) -> dict:
    from zerospeed.inference.quant import weight_bytes
    from zerospeed.testing.rss import reset_peak_rss

    rss_start = vm_hwm_bytes()
    net = build_model(args.model, args.seed)
    n_params = sum(p.numel() for p in net.parameters())
    t0 = time.perf_counter()
    keep, module = wrap(args.system, net)
    setup_s = time.perf_counter() - t0
    wbytes = weight_bytes(module)
    wpe_bytes = weight_bytes(module.transformer.wpe)  # the position table: a lookup, not read whole per token
    threads_after_setup = torch.get_num_threads()
    rss_after_setup = vm_hwm_bytes()

    gen = torch.Generator().manual_seed(args.prompt_seed)
    ids = torch.randint(0, VOCAB, (args.batch, args.prompt), generator=gen)
    mask = torch.ones_like(ids)

    def generate(n: int = args.new_tokens):
        """Exactly n new tokens (eos_token_id=None: nothing stops early): (wall s, CPU s, the ids)."""
        _barrier()
        t, c = time.perf_counter(), time.process_time()
        out = module.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, eos_token_id=None,
                              do_sample=False, pad_token_id=0)
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        if out.shape != (args.batch, args.prompt + n):
            raise RuntimeError(f"generate returned shape {tuple(out.shape)}, expected {(args.batch, args.prompt + n)}")
        return wall, cpu, out

    peaks = []  # VmHWM before each reset (the read probes' buffer is not the serving's memory)
    probing = int(os.environ.get("RANK", "0")) == 0
    reads_4k = []  # the same probe over 4 KiB pages (the judged one is on huge pages), before / after each generate

    def bracket() -> float | None:
        """Rank 0: the read bandwidth now (GB/s, huge pages), its buffer freed and the peak RSS reset after it."""
        nonlocal probing
        if not probing:
            return None
        peaks.append(vm_hwm_bytes())
        probing = reset_peak_rss()  # without a reset, the probe's buffer would count in the peak
        if not probing:
            return None
        torch.set_num_threads(2)  # as the run's own probes; the other rank waits at generate's barrier
        reads_4k.append(statistics.median(read_probe(BRACKET_TRIALS, huge=False)))
        gbs = statistics.median(read_probe(BRACKET_TRIALS))
        torch.set_num_threads(threads_after_setup)
        reset_peak_rss()  # the buffer is freed: the peak is the serving's again
        return gbs

    warmup_s, _, _ = generate()
    first_gen_at = time.time()
    prefill_s = [generate(1)[0] for _ in range(PREFILL_SAMPLES)]  # time to first token
    gen_s, gen_cpu_s, out = [], [], None
    reads = [bracket()]
    in_step = InStepCollectives() if world > 1 else contextlib.nullcontext()
    for _ in range(args.inner):
        with in_step:
            wall, cpu, out = generate()
        gen_s.append(wall)
        gen_cpu_s.append(cpu)
        reads.append(bracket())
    comm = {}
    if world > 1:  # what tensor parallelism adds per token here: the step's collectives, counted and timed
        comm = {"collectives_per_token": collectives_per_token(module, args.batch),
                "collective_s": collective_seconds(keep.tp.group, args.batch, MODELS[args.model]["n_embd"],
                                                   VOCAB),
                # seconds inside the step's collectives per timed generate (this rank), and their calls
                "in_step_collective_s": in_step.seconds, "in_step_collective_calls": in_step.calls}
    per_rank = [{"peak_rss_bytes": max([vm_hwm_bytes(), *peaks]), "start_rss_bytes": rss_start,
                 "setup_rss_bytes": rss_after_setup, "weight_bytes": wbytes, "wpe_bytes": wpe_bytes}]
    if world > 1:
        import torch.distributed as dist

        gathered = [None] * world
        dist.all_gather_object(gathered, per_rank[0])
        per_rank = gathered
    del keep
    _barrier()
    return {
        "status": "ok", "n_params": n_params, "threads_after_setup": threads_after_setup, "setup_s": setup_s, "warmup_s": warmup_s,
        "prefill_s": prefill_s, "gen_s": gen_s, "gen_cpu_s": gen_cpu_s,
        "peak_rss_bytes": [r["peak_rss_bytes"] for r in per_rank],
        "start_rss_bytes": [r["start_rss_bytes"] for r in per_rank],
        "setup_rss_bytes": [r["setup_rss_bytes"] for r in per_rank],
        "weight_bytes": [r["weight_bytes"] for r in per_rank],
        "wpe_bytes": [r["wpe_bytes"] for r in per_rank],
        **comm,
        "gen_read_gbs": reads,  # read GB/s before generate i is [i], after it [i + 1] (rank 0; huge pages)
        "gen_read_gbs_4k": reads_4k, "probe_huge_pages": PROBE_HUGE_PAGES,
        "launch_to_first_generate_s": first_gen_at - (args.launch_time or _T_PROCESS),
        "tokens": out[:, args.prompt:].tolist(),
    }


# -- the machine's bandwidth (the parent runs this in a process of its own) ------------------------------------------
def read_probe(trials: int = 7, huge: bool = True) -> list[float]:
    """GB/s (1e9 B/s) of each of `trials` `x.sum()` over a 512 MiB fp32 tensor (after one untimed), at the current
    thread count: the machine's read bandwidth. huge: the tensor moved onto 2 MiB pages first
    (`collapse_huge_pages`, as kernel injection does with the decode step's weights since session 26), so the
    rate is the memory's, not the 4 KiB page walks'; where the OS cannot, 4 KiB pages (`PROBE_HUGE_PAGES`)."""
    global PROBE_HUGE_PAGES
    from zerospeed.offload.hostmem import collapse_huge_pages

    x = torch.ones(512 * 2**20 // 4, dtype=torch.float32)
    if huge:
        PROBE_HUGE_PAGES = collapse_huge_pages(x)
    x.sum()
    rates = []
    for _ in range(trials):
        t = time.perf_counter()
        x.sum()
        rates.append(x.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return rates


def measure_bandwidth(models: list[str], threads: int = 2, trials: int = 7) -> dict:
    """Read bandwidth: median of `trials` `x.sum()` over a 512 MiB fp32 tensor, GB/s (1e9 B/s). Eager fp32 GEMV rate
    per model: `F.linear` of a [1, in] vector over every weight matrix of that GPT-2 (per block c_attn [3d, d],
    attn c_proj [d, d], c_fc [4d, d], mlp c_proj [d, 4d]; the lm_head [vocab, d]), all distinct tensors, one pass =
    one decode step's matrices; bytes of the matrices / median pass time."""
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    out = {"threads": threads, "trials": trials}
    out["read_gbs_all"] = read_probe(trials)
    out["read_gbs"] = statistics.median(out["read_gbs_all"])
    out["probe_huge_pages"] = PROBE_HUGE_PAGES
    out["read_gbs_4k"] = statistics.median(read_probe(trials, huge=False))
    out["gemv_gbs"] = {}
    for name in models:
        d, layers = MODELS[name]["n_embd"], MODELS[name]["n_layer"]
        shapes = [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)] * layers + [(VOCAB, d)]
        mats = [torch.randn(s, dtype=torch.float32) for s in shapes]
        vecs = {i: torch.randn(1, i) for i in {s[1] for s in shapes}}
        nbytes = sum(m.numel() * 4 for m in mats)

        times = []
        for trial in range(trials + 1):  # the first pass untimed (page faults, oneDNN set-up)
            t = time.perf_counter()
            for m in mats:
                F.linear(vecs[m.shape[1]], m)
            if trial:
                times.append(time.perf_counter() - t)
        out["gemv_gbs"][name] = nbytes / statistics.median(times) / 1e9
        del mats
    out["kernel_of_probe"] = {name: kernel_of_probe(MODELS[name]["n_embd"], trials) for name in models}
    return out


def kernel_of_probe(d: int, trials: int = 7) -> float:
    """The ceiling the decode step's kernels put on the fraction of the bound: inductor's frozen GEMV template
    (kernel injection's compile options) over a [VOCAB, d] fp32 lm_head, its packed weights on huge pages as
    kernel injection puts them, against `read_probe` (huge pages), alternating `trials` times; the median of
    the GEMV's GB/s over the probe's."""
    import torch._inductor.config as inductor_config

    from zerospeed.inference.inject import DECODE_COMPILE_OPTIONS, _code_modules, constants_onto_huge_pages

    lin, x = torch.nn.Linear(d, VOCAB, bias=False), torch.randn(1, d)
    loaded = len(_code_modules())
    with torch.no_grad(), inductor_config.patch(freezing=True):
        gemv = torch.compile(lin, options=DECODE_COMPILE_OPTIONS)
        gemv(x)
        constants_onto_huge_pages(loaded)
        ratios = []
        for _ in range(trials):
            probe = statistics.median(read_probe(3))
            gemv(x)
            t = time.perf_counter()
            for _ in range(3):
                gemv(x)
            ratios.append(VOCAB * d * 4 * 3 / (time.perf_counter() - t) / 1e9 / probe)
    return statistics.median(ratios)


# -- main --------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--system", required=True, choices=sorted(SYSTEMS))
    p.add_argument("--model", required=True, choices=sorted(MODELS))
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--inner", type=int, default=2, help="timed generate calls")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed before building the model")
    p.add_argument("--prompt-seed", type=int, default=1234, help="seed of the prompt's random token ids")
    p.add_argument("--result", required=True, help="JSON file rank 0 writes")
    p.add_argument("--launch-time", type=float, default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    threads = int(os.environ.get("OMP_NUM_THREADS", "2" if world == 1 else "1"))
    torch.set_num_threads(threads)
    meta = {k: getattr(args, k) for k in ("system", "model", "batch", "prompt", "new_tokens", "inner", "seed",
                                          "prompt_seed")}
    meta.update(world_size=world, threads=threads, torch=torch.__version__)
    if world != SYSTEMS[args.system][3]:
        raise SystemExit(f"{args.system} runs at world size {SYSTEMS[args.system][3]}, launched at {world}")
    try:
        import transformers

        meta["transformers"] = transformers.__version__
        if SYSTEMS[args.system][0] == "deepspeed":
            import deepspeed

            meta["deepspeed"] = deepspeed.__version__
        result = run(args, world)
        code = 0
    except Exception as e:  # noqa: BLE001 - reported in the table, the benchmark goes on
        result = {"status": "error", "message": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        print(result["traceback"], file=sys.stderr, flush=True)
        code = 1
    if rank == 0:
        tmp = Path(args.result).with_suffix(".tmp")
        tmp.write_text(json.dumps({**meta, **result}))
        tmp.replace(args.result)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    return code


if __name__ == "__main__":
    sys.exit(main())
