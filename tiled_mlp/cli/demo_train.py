"""The demo's training loop: a tiny Llama (random init from a config, no downloads) trained on
synthetic long sequences, untiled then tiled from the same seed, with loss and peak memory per step.

Runs in one process, or as a torchrun worker (``--strategy fsdp2|deepspeed``) on CPU with gloo. With
``--sp N`` the ranks train the whole long-sequence stack (``apply_long_context``: tiled MLP, tiled
RMSNorms, tiled loss, checkpoint offload, Ulysses SP over N ranks) on the same sequences, and rank 0 also trains the plain model
in one process: the losses must be equal.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

from ..bench.memory_tracker import LiveMemoryTracker
from . import parsing

MiB = 2**20
HEADS = 4  # the tiny Llama's attention heads (and key/value heads)


def tiny_llama(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                         max_position_embeddings=max(args.seq, 2048))
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    model.set_attn_implementation("sdpa")
    return model


def synthetic_batches(args, rank: int):
    generator = torch.Generator().manual_seed(args.seed + 1 + rank)
    return [torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator) for _ in range(args.steps)]


def _wrap(model, args):
    """The model under the chosen backend (DDP when sequence parallelism has none), and a function doing
    one optimizer step."""
    if args.strategy == "deepspeed":
        import deepspeed

        config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "SGD", "params": {"lr": args.lr}},
                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                  "zero_allow_untested_optimizer": True}
        with contextlib.redirect_stdout(sys.stderr):
            engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())

        def engine_step(loss):
            engine.backward(loss)
            engine.step()

        return engine, engine_step
    if args.strategy == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif args.sp > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

    def step(loss):
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, step


def train(args, tiled: bool, rank: int):
    from ..integrations.hf import apply_tiled_mlp

    model = tiny_llama(args)
    if tiled:
        apply_tiled_mlp(model, num_shards=args.num_shards)
    model, step = _wrap(model, args)
    losses, peaks = [], []
    for input_ids in synthetic_batches(args, rank):
        tracker = LiveMemoryTracker()
        tracker.track(*[p for p in model.parameters()], input_ids)
        with tracker:
            loss = model(input_ids=input_ids, labels=input_ids).loss
            step(loss)
        losses.append(loss.item())
        peaks.append(tracker.peak_bytes / MiB)
    return losses, peaks


def train_stack(args) -> tuple:
    """Every rank: the stack with SP over ``args.sp`` ranks, on the same sequences (rank 0's); the
    losses, and the host memory the offload held at most."""
    import torch.distributed as dist

    from ..integrations.stack import apply_long_context

    model = tiny_llama(args)
    stack = apply_long_context(model, sequence_parallel=args.sp, num_shards=args.num_shards, micro_batch_size=args.batch)
    sp, offload = stack.sequence_parallel, stack.offload
    assert sp is not None and offload is not None  # both asked for above
    model, step = _wrap(model, args)
    losses = []
    for input_ids in synthetic_batches(args, rank=dist.get_rank() // args.sp):
        loss = model(**sp.shard({"input_ids": input_ids, "labels": input_ids})).loss
        step(loss)
        losses.append(loss.item())
    host = offload.host_bytes.peak / MiB
    stack.remove()
    return losses, host


def train_plain(args) -> list:
    """One process, the whole sequence: the plain model, untiled, nothing offloaded."""
    model = tiny_llama(args)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    losses = []
    for input_ids in synthetic_batches(args, rank=0):
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def report_stack(args, rank: int) -> None:
    stacked, host = train_stack(args)
    if rank != 0:
        return
    plain = train_plain(args)
    print(f"tiny Llama hidden={args.hidden} intermediate={args.intermediate} layers={args.layers} seq={args.seq} "
          f"batch={args.batch}, CPU, float32: tiled MLP + tiled RMSNorms + tiled loss + checkpoint offload + Ulysses SP={args.sp} "
          f"({args.strategy or 'ddp'} x{os.environ.get('WORLD_SIZE', 1)}, {args.seq // args.sp} tokens per rank) "
          "against the plain model in one process")
    print("| step | one process | SP stack | |diff| |")
    print("|---|---|---|---|")
    for i, (one, many) in enumerate(zip(plain, stacked, strict=True)):
        print(f"| {i} | {one:.6f} | {many:.6f} | {abs(one - many):.1e} |")
    worst = max(abs(a - b) for a, b in zip(plain, stacked, strict=True))
    print(f"largest loss difference: {worst:.2e}; host memory held by the offload (rank 0, at most): {host:.2f} MiB")


def report(args, rank: int) -> None:
    if args.sp > 1:
        report_stack(args, rank)
        return
    untiled = train(args, tiled=False, rank=rank)
    tiled = train(args, tiled=True, rank=rank)
    if rank != 0:
        return
    where = f"{args.strategy} x{os.environ.get('WORLD_SIZE', 1)}" if args.strategy else "one process"
    print(f"tiny Llama hidden={args.hidden} intermediate={args.intermediate} layers={args.layers} seq={args.seq} "
          f"batch={args.batch} ({where}, CPU, float32); peak = live tensor memory during the step")
    print("| step | untiled loss | tiled loss | |diff| | untiled peak MiB | tiled peak MiB |")
    print("|---|---|---|---|---|---|")
    for i, (lu, pu, lt, pt) in enumerate(zip(*untiled, *tiled, strict=True)):
        print(f"| {i} | {lu:.6f} | {lt:.6f} | {abs(lu - lt):.1e} | {pu:.1f} | {pt:.1f} |")
    worst = max(abs(a - b) for a, b in zip(untiled[0], tiled[0], strict=True))
    print(f"largest loss difference: {worst:.2e}")


def add_arguments(p) -> None:
    p.add_argument("--seq", type=parsing.positive_int, default=4096)
    p.add_argument("--batch", type=parsing.positive_int, default=1)
    p.add_argument("--steps", type=parsing.positive_int, default=3)
    p.add_argument("--hidden", type=parsing.positive_int, default=128)
    p.add_argument("--intermediate", type=parsing.positive_int, default=2048)
    p.add_argument("--layers", type=parsing.positive_int, default=2)
    p.add_argument("--vocab", type=parsing.positive_int, default=256)
    p.add_argument("--num-shards", type=parsing.shards, default="auto")
    p.add_argument("--lr", type=parsing.positive_float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strategy", choices=["fsdp2", "deepspeed"], default=None,
                   help="distributed backend (needs --nproc >= 2)")
    p.add_argument("--sp", type=parsing.positive_int, default=1,
                   help="Ulysses sequence parallelism over this many ranks, with the tiled norms, the tiled loss and "
                        "checkpoint offload, against the plain model in one process (needs --nproc equal to it)")


def worker_main(argv=None) -> None:
    """Entry point of each torchrun rank."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv)
    import torch.distributed as dist

    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.strategy == "deepspeed" or args.sp > 1:
        import deepspeed

        with contextlib.redirect_stdout(sys.stderr):
            deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    try:
        report(args, dist.get_rank())
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    worker_main()
