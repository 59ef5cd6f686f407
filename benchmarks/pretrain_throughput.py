"""Training throughput of each member of a pretraining family, a few seconds per depth.

    python benchmarks/pretrain_throughput.py experiments/pretrain/lm_cpu.yaml [--seconds 6] [--hours 1] [key=value ...]

Runs `hfl pretrain`'s training step (AdamW, gradient clipping, the config's batch size, threads and
device) on random tokens or images, which cost what real ones do, and prints each depth's tokens
(or images) per second, the median of the steps after the first, then the per-member budget that
trains every depth of the family in `--hours`. Pick the config's `budget` from it and update
`hfl.pretrain.CPU_SECONDS_PER_UNIT` when the machine's rates change.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from hfl.pretrain import build_member, load_pretrain_config, parameter_groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--seconds", type=float, default=6.0, help="timed seconds per depth (at least 3 steps)")
    parser.add_argument("--hours", type=float, default=1.0, help="the wall time the suggested budget fills")
    args = parser.parse_args()
    config = load_pretrain_config(args.config, args.overrides)
    torch.set_num_threads(config.threads)
    device = torch.device("cuda" if config.device != "cpu" and torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(0)
    if config.model == "gpt":
        outputs = 81 if config.tokenizer == "chars" else 256
        ids = torch.randint(0, outputs, (config.batch_size, config.context + 1), generator=gen).to(device)
        x, y = ids[:, :-1], ids[:, 1:]
    else:
        outputs = 5
        x = torch.randn(config.batch_size, 3, 32, 32, generator=gen).to(device)
        y = torch.randint(0, outputs, (config.batch_size,), generator=gen).to(device)
    seconds_per_unit = {}
    for depth in config.depths:
        model = build_member(config, depth, outputs).to(device)
        optimizer = torch.optim.AdamW(parameter_groups(model, config.weight_decay), lr=config.lr, betas=tuple(config.betas))
        times: list[float] = []
        start = time.perf_counter()
        while len(times) < 4 or time.perf_counter() - start < args.seconds:
            t = time.perf_counter()
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip or float("inf"))
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        step = statistics.median(times[1:])
        seconds_per_unit[depth] = step / config.units_per_step
        print(f"l{depth}: {config.units_per_step / step:,.0f} {config.unit}s/s ({step * 1000:.0f} ms/step, {len(times) - 1} steps timed)")
    total = sum(seconds_per_unit.values())
    budget = args.hours * 3600 / total
    print(f"all {len(config.depths)} depths in {args.hours:g} h: budget = {args.hours * 3600:.0f} s / {total:.3g} s per {config.unit} "
          f"= {budget:,.0f} {config.unit}s per member ({budget / config.units_per_step:,.0f} steps of {config.units_per_step})")


if __name__ == "__main__":
    main()
