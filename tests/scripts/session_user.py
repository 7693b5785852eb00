"""A user's own training script for the session tests: 2 ranks over gloo, a state that depends on every step
(each rank's seeded random numbers, summed over the ranks), reports, checkpoints and resumes it."""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
import torch.distributed as dist

import clusterfit.session as cf


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=2, help="checkpoint every this many steps")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds between steps")
    parser.add_argument("--hang-at", type=int, default=-1, help="every rank stops reporting after this step")
    parser.add_argument(
        "--hold", default="", help="STEP:FILE: after reporting STEP, wait (at most 120 s) until the test makes FILE"
    )
    args = parser.parse_args()

    ctx = cf.context()
    dist.init_process_group("gloo")
    rng = random.Random(1000 + ctx.rank)
    value, first = 0.0, 0
    resume = cf.latest_checkpoint()
    if resume is not None:
        saved = json.loads((resume.folder / "state.json").read_text())
        value, first = saved["value"], resume.step + 1
        rng.setstate((saved["rng"][0], tuple(saved["rng"][1]), saved["rng"][2]))
        print(f"resumed from step {resume.step} (attempt {ctx.attempt})", flush=True)
    for step in range(first, args.steps):
        drawn = torch.tensor([rng.random()], dtype=torch.float64)
        dist.all_reduce(drawn)
        value = value * 0.5 + drawn.item()
        cf.report(step=step, total_steps=args.steps, score=value, rank_value=float(ctx.rank), node=float(ctx.node_rank))
        if step == args.hang_at:
            time.sleep(3600)
        if args.hold and step == int(args.hold.split(":", 1)[0]):
            go, deadline = Path(args.hold.split(":", 1)[1]), time.monotonic() + 120
            while not go.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        stop = cf.should_stop()
        if (step + 1) % args.every == 0 or stop:
            with cf.checkpoint(step) as folder:
                (folder / "state.json").write_text(json.dumps({"value": value, "rng": rng.getstate()}))
        if stop:
            print(f"stopping at step {step} on request", flush=True)
            break
        time.sleep(args.sleep)
    else:
        final = ctx.outputs_dir / f"final-rank-{ctx.rank}.json"
        final.write_text(json.dumps({"value": value, "steps": args.steps}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
