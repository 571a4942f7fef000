#!/usr/bin/env python
"""The plain-PyTorch side of the benchmarks: a hand-written training loop over Loom's GPT.

Imports `loom.models.gpt.network.GPT` (and `loom.worker.host_memory`, the glibc heap settings Loom's
CPU ranks apply, and `loom.data.index`'s numpy permutation, so the sample order is Loom's)
and nothing else of Loom, so it measures what PyTorch alone costs for the same work as `loom
train`: the same token file (the tinycode store's one shard of bytes, in non-overlapping
windows of seq_len + 1, as loom.data.mix.SourceWindows), the same global order (an epoch's
seeded permutation, each global batch the same samples; torch's DistributedSampler deals it
to the ranks), the same AdamW groups (decay on matrices only) with linear
warmup and cosine decay stepped per step, the same gradient clipping and the same seed
(seeded right before the model is built, as Loom's worker does).

One process: `python plain_gpt.py --config JSON --steps N`. Several: run it under
`torchrun --nproc-per-node=2` and it trains with torch DDP over gloo (GPU: NCCL).
`--device cuda --dtype bf16 --compile` is the GPU path of gpu_mfu.py (autocast bf16).

Prints "step 1/N" after the first step and one JSON line (rank 0) with the loop time, the per-step losses and the final loss
computed as Loom's summary does (mean of the last logging window, averaged over ranks).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True, help="JSON: model, optim, dataset, trainer, seed, tokens")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--import-lightning", action="store_true",
                    help="import pytorch_lightning first, as a Lightning user's script does (startup.py)")
    ap.add_argument("--warmup-steps", type=int, default=0,
                    help="GPU timing: steps run before the timed window (--steps is the whole run)")
    ap.add_argument("--baton", metavar="DIR", help="take turns step by step with `loom train` (baton.py)")
    ap.add_argument("--side", default="b", help="this side's name in the baton (a moves first)")
    ap.add_argument("--slow", type=float, default=0.0, help="add this fraction of each step's time to it")
    ap.add_argument("--slow-kind", default="sleep", choices=["sleep", "spin"])
    args = ap.parse_args(argv)
    c = json.loads(args.config)

    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    # Threads as Loom's worker sets them: this machine's cores / processes on it.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // local_world)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    # The heap settings Loom's CPU ranks apply (as the fused AdamW below): without them this
    # loop's page faults per step vary between processes (6 to 5,000 seen) and its step with them.
    from loom.worker.host_memory import keep_heap

    keep_heap(args.device)

    if args.import_lightning:
        import pytorch_lightning  # noqa: F401

    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, Dataset, DistributedSampler

    from loom.models.gpt.network import GPT
    from loom.models.llama.network import Llama

    torch.set_num_threads(threads)
    device = torch.device(args.device)
    if world > 1:
        import torch.distributed as dist

        if device.type == "cuda":
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")

    from loom.data.index import Permutation
    from loom.data.index.feistel import seed_key

    class LoomOrder(DistributedSampler):
        """Epoch e: Loom's permutation of the windows (a one-source mixture's, seed_key(seed,
        0, e)), cut to whole global batches, dealt to the ranks as DistributedSampler deals."""

        def __init__(self, n: int, world: int, rank: int, seed: int, global_batch: int) -> None:
            self.n, self.world, self.rank, self.seed, self.epoch = n, world, rank, seed, 0
            self.keep = n // global_batch * global_batch

        def __len__(self) -> int:
            return self.keep // self.world

        def __iter__(self):
            order = Permutation(self.n, seed_key(self.seed, 0, self.epoch))(np.arange(self.keep))
            return iter(order[self.rank::self.world].tolist())

    class Windows(Dataset):
        def __init__(self, path: str, seq_len: int) -> None:
            self.tokens = np.memmap(path, dtype=np.uint8, mode="r")
            self.seq_len = seq_len
            self.n = max(0, (len(self.tokens) - 1) // seq_len)

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int):
            s = i * self.seq_len
            chunk = torch.from_numpy(self.tokens[s : s + self.seq_len + 1].astype(np.int64))
            return chunk[:-1], chunk[1:]

    seed = int(c["seed"])
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # Loom's own network of the model group (Llama for llama*, else GPT), from the group's keys
    # that are its arguments (name, init_from, ... are Loom's).
    import inspect

    network = Llama if str(c["model"].get("name", "")).startswith("llama") else GPT
    model = network(**{k: v for k, v in c["model"].items() if k in inspect.signature(network).parameters}).to(device)

    o, steps_total = c["optim"], args.steps  # Loom runs with trainer.max_steps=N
    named = list(model.named_parameters())
    decay = [p for _, p in named if p.requires_grad and p.dim() >= 2]
    no_decay = [p for _, p in named if p.requires_grad and p.dim() < 2]
    # The same AdamW implementation as Loom's `optim.fused` (auto: torch's fused kernel wherever
    # torch has one, CPU included). torch's own default on CPU is the per-tensor loop, about 3x
    # slower for gpt_small's 53 tensors: that alone made this loop slower than `loom train`.
    fused = o.get("fused", "auto")
    if fused == "auto":
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        fused = device.type in _get_fused_kernels_supported_devices()
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"], fused=bool(fused),
    )
    warmup, floor = o["warmup_steps"], o["min_lr_ratio"]

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps_total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    if args.compile:
        model = torch.compile(model)
    train_model = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        train_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                          bucket_cap_mb=c.get("bucket_cap_mb", 25))

    ds = c["dataset"]
    data = Windows(c["tokens"], ds["seq_len"])
    sampler = LoomOrder(len(data), world, rank, seed, ds["batch_size"] * world)
    loader = DataLoader(data, batch_size=ds["batch_size"], sampler=sampler, drop_last=True,
                        pin_memory=device.type == "cuda")
    clip = float(c["trainer"].get("gradient_clip_val") or 0.0)
    params = [p for g in opt.param_groups for p in g["params"]]
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if args.dtype == "bf16"
                else torch.autocast(device.type, enabled=False))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    losses: list[torch.Tensor] = []
    step, epoch = 0, 0
    stepper = None
    if args.baton:  # --slow applies in turns only
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from baton import Stepper

        stepper = Stepper(args.baton, args.side, args.steps, args.slow, args.slow_kind)
    sync()
    t0 = time.perf_counter()
    if stepper:
        stepper.first()
    t_warm = t0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            with autocast:
                logits = train_model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
            sched.step()
            losses.append(loss.detach())
            step += 1
            if step == 1 and rank == 0:  # startup.py's marker, as Loom's "step 1/N" line
                print(f"step 1/{args.steps}", flush=True)
            if stepper:
                stepper.boundary()
            if step == args.warmup_steps:
                sync()
                t_warm = time.perf_counter()
            if step >= args.steps:
                break
        epoch += 1
    sync()
    loop = time.perf_counter() - t0
    if stepper:
        stepper.finish({"threads": threads})
    timed = time.perf_counter() - t_warm

    # Loom's summary final_loss: mean of the losses since the last logged step, over ranks.
    log_every = int(c["trainer"]["log_every_n_steps"])
    last_log = ((step - 1) // log_every) * log_every
    window = losses[last_log:]
    acc = None
    for t in window:
        acc = t if acc is None else acc + t
    local_final = float((acc / len(window)).float().item())
    final = local_final
    if world > 1:
        import torch.distributed as dist

        v = torch.tensor([local_final], dtype=torch.float64, device=device)
        out = [torch.zeros_like(v) for _ in range(world)]
        dist.all_gather(out, v)
        final = float(torch.cat(out).cpu().mean())
    if rank == 0:
        print(json.dumps({
            "steps": step, "loop_time_s": loop, "timed_steps": step - args.warmup_steps, "timed_time_s": timed,
            "final_loss": final, "losses": [float(t) for t in losses], "threads": threads, "world_size": world,
            "peak_gpu_mem_gb": (torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None),
        }), flush=True)
    if world > 1:
        import torch.distributed as dist

        dist.barrier()  # no rank tears gloo down while its peer is still in a collective
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
