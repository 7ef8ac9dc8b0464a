"""`bench_offload.py --largest` (issue 22): the largest GPTs ZeRO-Infinity trains on this node.

Models: big:LxD GPTs (L blocks of width D, vocab 256, untied) of about 1B, 2B and 4B parameters, bf16
and fp32 (a model key's `@bf16` suffix), world size 2, both tiers on NVMe, activation checkpointing of
every block, the slices on NVMe from the build on (`zero.Init(remote_device="nvme")`), 8 parameter
buffers, sub_group_size 1e7 with pipelined optimizer reads/writes. A model whose swap files would not
fit the free disk (zerospeed's own `offload.budget` prediction, 3% slack) is skipped with the numbers.

Columns: step time (median of the timed steps, the first step - which creates the Adam states - not
timed); the I/O bound = (bytes read by both ranks / raw read bandwidth) + (bytes written / raw write
bandwidth), per step, from /proc/self/io and the raw O_DIRECT figures of the same run (one disk: reads
and writes share it); peak current RSS per rank in each phase (build under Init, initialize, train)
against the predicted host budget (`offload.budget.rank_budget` + the process's RSS at start);
swap files against the predicted disk bytes.
"""
from __future__ import annotations

MODELS = "big:20x2048@bf16,big:20x2048,big:26x2560@bf16,big:26x2560,big:52x2560@bf16,big:44x2560"
# a model key's '+super' suffix: offload_optimizer.super_offload (the optimizer steps during the backward and the
# next forward; bf16 without check_grad_overflow); '--big-modes mem,nvme' adds the in-memory run of each model (the
# compute floor: the column step / max(I/O bound, in-memory step))
WORKER_FLAGS = ["--ckpt", "--init-nvme", "--pipeline", "--param-buffers", "8"]
MiB, GiB = 1 << 20, 1 << 30


def disk_need(model: str, world: int = 2) -> int:
    """Bytes the node's swap files take for `model` ('big:LxD[@bf16]') under the --largest settings."""
    from zerospeed.offload import OffloadPolicy
    from zerospeed.offload.budget import rank_budget

    name, _, precision = model.partition("+")[0].partition("@")
    layers, width = (int(v) for v in name.split(":", 1)[1].split("x"))
    numel = layers * (12 * width * width + 2 * width) + 2 * 256 * width + width
    pol = OffloadPolicy(optimizer="nvme", param="nvme", max_in_cpu=0, sub_group_size=10_000_000)
    mixed = precision == "bf16"
    b = rank_budget(pol, numel=numel, largest_unit=12 * width * width, world=world, param_bytes=2 if mixed else 4,
                    mixed=mixed)
    return world * b.disk_total


def _parse(key: str) -> tuple[int, int, str]:
    """'big:52x2560@bf16' -> (52, 2560, 'bf16')."""
    name, _, precision = key.partition("@")
    layers, width = (int(v) for v in name.split(":", 1)[1].split("x"))
    return layers, width, precision or "fp32"


def extrapolated_floors(mem_step: dict[str, float]) -> dict[tuple[int, str], tuple[float, float, str]]:
    """{(width, precision): (intercept s, s per layer, how)}: a least-squares line through the in-memory runs of
    two or more layer counts at one width and precision: a step is a fixed part (embeddings, head, start-up of
    the collectives) plus one block's time per layer. `floor_of` evaluates it for a model key."""
    groups: dict[tuple[int, str], list[tuple[int, float]]] = {}
    for key, t in mem_step.items():
        layers, width, precision = _parse(key)
        groups.setdefault((width, precision), []).append((layers, t))
    out = {}
    for group, pts in groups.items():
        if len({n for n, _ in pts}) < 2:
            continue
        n = len(pts)
        mx, my = sum(p[0] for p in pts) / n, sum(p[1] for p in pts) / n
        slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
        icpt = my - slope * mx
        out[group] = (icpt, slope, f"{icpt:.2f} s + {slope:.3f} s x layers, from "
                      + ", ".join(f"{x} layers {y:.1f} s" for x, y in sorted(pts)))
    return out


def floor_of(key: str, floors: dict) -> tuple[float, str] | None:
    """(extrapolated in-memory step s, how) of model key 'big:LxD[@precision]', or None."""
    layers, width, precision = _parse(key)
    line = floors.get((width, precision))
    return None if line is None else (line[0] + line[1] * layers, line[2])


def _label(r: dict) -> tuple[str, str]:
    """(model, precision + variants) of a run's model key, e.g. ('big:52x2560', 'bf16+super')."""
    base, plus, variant = r["model"].partition("+")
    model, _, precision = base.partition("@")
    return model, (precision or "fp32") + plus + variant


def markdown(saved: dict) -> str:
    raw = saved["raw"]
    lines = [f"bench_offload --largest {saved['stamp']}: ZeRO-3, AdamW, world size 2 (gloo, 1 thread/rank), "
             f"micro-batch {saved['args']['micro_batch']} x seq {saved['args']['seq']}, both tiers on NVMe, activation "
             f"checkpointing, Init(remote_device='nvme'); {saved['machine']}; load avg "
             f"{min(saved['loads']):.1f}-{max(saved['loads']):.1f}",
             "",
             f"Raw O_DIRECT bandwidth, MB/s read / write: dd {raw['dd_read']:,.0f} / {raw['dd_write']:,.0f}; "
             + (f"{raw['streams']} dd at once (aggregate) {raw['ddN_read']:,.0f} / {raw['ddN_write']:,.0f}; "
                if "ddN_read" in raw else "") + f"AsyncIO 1 "
             f"worker {raw['aio1_read']:,.0f} / {raw['aio1_write']:,.0f}; 8 workers {raw['aio8_read']:,.0f} / "
             f"{raw['aio8_write']:,.0f}; best {raw['best_read']:,.0f} / {raw['best_write']:,.0f} (the I/O bound uses these).",
             "",
             "| model (params) | precision | step s wall / CPU (forward+backward) | I/O bound s | step / bound | step / "
             "bound at the faster of raw and achieved | step / max(bound, in-memory step) | peak RSS/rank MiB: build / initialize / train | predicted MiB (process + "
             "budget) | read / written per step per rank, GB | achieved MB/s read / write (% of raw) | swap files GB "
             "(predicted) | losses |",
             "|" + "---|" * 13]
    mem_step = {}  # model@precision -> median step of its in-memory run (the compute floor; --big-modes mem)
    for r in saved["runs"]:
        if r.get("mode") == "mem" and r["status"] == "ok":
            t = sorted(r["step_s"][r["warmup"]:])
            mem_step[r["model"].partition("+")[0]] = t[len(t) // 2]
    floors = extrapolated_floors(mem_step)
    for r in saved["runs"]:
        model, precision = _label(r)
        precision += (" in memory" if r.get("mode") == "mem" else "") + (
            " (DeepSpeed)" if r.get("system") == "deepspeed" else "")
        if r["status"] != "ok":
            lines.append(f"| {model} | {precision} | {r['status']}: {r.get('message', '')[:240]} |" + " |" * 11)
            continue
        timed = r["step_s"][r["warmup"]:]
        step = sorted(timed)[len(timed) // 2]
        cpu = sorted(r["cpu_s"][r["warmup"]:])[len(timed) // 2]
        fb = r.get("forward_backward_s")
        fb = f" ({sorted(fb[r['warmup']:])[len(timed) // 2]:.1f})" if fb else ""
        io, n = r["io"], len(timed)
        rd = sum(x["disk_read"] for x in io) / n
        wr = sum(x["disk_written"] for x in io) / n
        bound = rd / (raw["best_read"] * 1e6) + wr / (raw["best_write"] * 1e6)
        key = r["model"].partition("+")[0]
        floor = max(bound, mem_step.get(key) or (floor_of(key, floors) or (0.0, ""))[0])
        ph = r["phase_rss_bytes"]
        peaks = " / ".join(f"{max(p[k] for p in ph) / MiB:,.0f}" for k in ("build", "initialize", "train"))
        pred = (max(r["start_rss_bytes"]) + r["predicted_host_bytes"]) / MiB if r.get("predicted_host_bytes") else None
        bw_r = sum(x["aio_read"] / x["aio_busy_read_s"] for x in io if x["aio_busy_read_s"]) / 1e6
        bw_w = sum(x["aio_written"] / x["aio_busy_write_s"] for x in io if x["aio_busy_write_s"]) / 1e6
        # the run itself moved bytes faster than the raw probe measured: the bound at the faster rate is tighter
        fast = rd / (max(raw["best_read"], bw_r) * 1e6) + wr / (max(raw["best_write"], bw_w) * 1e6)
        disk = sum(r["swap_bytes"]) / 1e9
        pdisk = 2 * r["predicted_disk_bytes"] / 1e9 if r.get("predicted_disk_bytes") else float("nan")
        losses = ", ".join(f"{x:.3f}" for x in r["losses"])
        if r.get("mode") == "mem":
            lines.append(f"| {model} ({r['n_params'] / 1e9:.2f}B) | {precision} | {step:.1f} / {cpu:.1f}{fb} | - | - | - | - | "
                         f"{peaks} | | | | | {losses} |")
            continue
        lines.append(f"| {model} ({r['n_params'] / 1e9:.2f}B) | {precision} | {step:.1f} / {cpu:.1f}{fb} | {bound:.1f} | "
                     f"{step / bound:.2f}x | {step / fast:.2f}x | {step / floor:.2f}x | {peaks} | {'-' if pred is None else f'{pred:,.0f}'} | {rd / len(io) / 1e9:.1f} / {wr / len(io) / 1e9:.1f} | "
                     f"{bw_r:,.0f} / {bw_w:,.0f} ({100 * bw_r / raw['best_read']:.0f}% / "
                     f"{100 * bw_w / raw['best_write']:.0f}%) | {disk:.1f} ({pdisk:.1f}) | {losses} |")
    nvme_keys = {r["model"].partition("+")[0] for r in saved["runs"] if r.get("mode") == "nvme"}
    extra = {k: f for k in nvme_keys - set(mem_step) if (f := floor_of(k, floors)) is not None}
    if extra:
        lines += ["", "In-memory step (the compute floor) of the models too large for memory, extrapolated linearly in "
                  "the layer count from the in-memory runs of the same width and precision (the step / max column uses "
                  "it):", ""] + [f"- {k}: {t:.1f} s ({how})" for k, (t, how) in sorted(extra.items())]
    split = [r for r in saved["runs"] if r["status"] == "ok" and r.get("phase_split_s")]
    if split:
        lines += ["", "Where a timed step goes, per rank (rank 0 / rank 1), seconds: wall, process CPU, disk busy (a request "
                  "in flight), training thread waiting on I/O:", "",
                  "| model | precision | forward | backward | engine.step() |", "|---|---|---|---|---|"]
        for r in split:
            model, precision = _label(r)
            cells = [" / ".join(f"{x[ph][0]:.1f} wall, {x[ph][1]:.1f} CPU, {x[ph][2]:.1f} busy, {x[ph][3]:.1f} wait"
                                for x in r["phase_split_s"]) for ph in ("forward", "backward", "step")]
            lines.append(f"| {model} | {precision} {r.get('mode', '')} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
