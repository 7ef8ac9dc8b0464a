"""`zerospeed pipe-schedule`: which pipeline schedule is fastest for measured per-stage times (`simulate`).

    zerospeed pipe-schedule --stages 4 --microbatches 8 --forward 0.010 --backward-input 0.011 --backward-weight 0.009

Times are seconds per micro-batch for the layers one pipeline rank holds: one number for every rank, or one per
rank separated by commas. The backward splits into an input-gradient pass (B) and a weight-gradient pass (W):
time them as `torch.autograd.grad(outputs, stage inputs)` and then the backward to the weights alone; a fused
backward costs B + W. Prints every schedule that applies (step time, bubble fraction, peak activations in
units of one rank's layers, time against 1F1B), then the best and how to select it. Exit 2 with the message for
bad input.
"""
from __future__ import annotations

import argparse

from .schedule import SCHEDULE_LAYOUTS, candidate_schedules
from .simulate import StageTimes, best_schedule, simulate

_MODULE = {"one": "PipelineModule(...)", "interleaved": "PipelineModule(..., chunks={chunks})",
           "v": "PipelineModule(..., chunks=2, chunk_layout=\"v\") or DualPipeVModule(...)"}


def _times(text: str, stages: int, flag: str) -> float | tuple[float, ...]:
    values = [float(v) for v in text.split(",")]
    if any(v < 0 for v in values) or len(values) not in (1, stages):
        raise ValueError(f"{flag} takes one time >= 0 or {stages} comma-separated ones (one per rank), got {text!r}")
    return values[0] if len(values) == 1 else tuple(values)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="zerospeed pipe-schedule", description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, required=True, help="pipeline ranks (PipelineModule num_stages)")
    parser.add_argument("--microbatches", type=int, required=True, help="micro-batches per batch "
                        "(gradient_accumulation_steps)")
    parser.add_argument("--forward", default="1.0", help="forward seconds per micro-batch (one, or per rank)")
    parser.add_argument("--backward-input", default="1.0", help="input-gradient seconds per micro-batch")
    parser.add_argument("--backward-weight", default="1.0", help="weight-gradient seconds per micro-batch")
    parser.add_argument("--send-latency", type=float, default=0.0, help="seconds from a send to its arrival")
    parser.add_argument("--send-overhead", type=float, default=0.0, help="seconds the sending rank spends in one "
                        "send call (gloo on a busy CPU: ~0.3-0.5 ms)")
    parser.add_argument("--pass-overhead", type=float, default=0.0, help="seconds of executor work per forward or "
                        "backward pass (posting receives, hand-offs; ~0.5-1.5 ms on a busy CPU)")
    parser.add_argument("--chunks", type=int, default=2, help="model chunks per rank for interleaved 1F1B")
    args = parser.parse_args(argv)
    try:
        if args.stages < 1 or args.microbatches < 1 or args.chunks < 2:
            raise ValueError("--stages and --microbatches must be >= 1 and --chunks >= 2")
        times = StageTimes(forward=_times(args.forward, args.stages, "--forward"),
                           backward_input=_times(args.backward_input, args.stages, "--backward-input"),
                           backward_weight=_times(args.backward_weight, args.stages, "--backward-weight"),
                           send_latency=args.send_latency, send_overhead=args.send_overhead,
                           pass_overhead=args.pass_overhead)
        results = {name: simulate(build(), times)
                   for name, build in candidate_schedules(args.stages, args.microbatches, chunks=args.chunks).items()}
        best, _ = best_schedule(args.stages, args.microbatches, times, chunks=args.chunks)
    except ValueError as e:
        print(f"zerospeed pipe-schedule: {e}")
        return 2
    base = results["1f1b"].step_time
    print(f"{args.stages} pipeline ranks, {args.microbatches} micro-batches (simulated; seconds)\n")
    print("| schedule | step time | bubble | peak activations (rank's layers) | time vs 1f1b |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in results.items():
        chunks = {"one": 1, "interleaved": args.chunks, "v": 2}[SCHEDULE_LAYOUTS[name]]
        peak = max(r.peak_activations_per_rank) / chunks
        mark = " (best)" if name == best else ""
        print(f"| {name}{mark} | {r.step_time:.4g} | {r.bubble_fraction:.1%} | {peak:.3g} | {r.step_time / base:.3f}x |")
    module = _MODULE[SCHEDULE_LAYOUTS[best]].format(chunks=args.chunks)
    print(f"\nbest: {best}: build the model as {module} and set \"pipeline\": {{\"schedule\": \"{best}\"}}")
    return 0
