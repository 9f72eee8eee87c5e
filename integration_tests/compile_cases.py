"""The compiled distributed training runs (``test_fsdp2_compile``): what each case trains, on which data,
and its single-process reference.

A case trains a model whose decoder blocks are tiled (2 shards) and compiled one by one, as torchtitan
does (``torch.compile(block, fullgraph=True)`` put back in place of the block), then wrapped by FSDP2
(``fully_shard`` on each compiled block, then the root) or by DDP around the whole model. The reference
is the untiled model, uncompiled, in one process, on the ranks' batches concatenated: with equal token
counts per rank, its mean loss is the mean of the ranks' losses, and its gradient is what FSDP2 and DDP
average over the ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .tiny_models import VOCAB, tiny_model
from .toy_models import make_toy_model

STEPS = 3  # optimizer steps per run
TOKENS = 24  # per rank and step
HIDDEN = 16  # the toy model's hidden size (toy_models.ToyModel)
NUM_SHARDS = 2
LR = {"sgd": 0.1, "adamw": 1e-2}
# float64 throughout: the tiled and untiled runs sum the same products in another order (per shard, per
# rank), so they differ by a few ulps (measured worst relative error over every loss, gradient and
# parameter: 8.3e-16 with SGD, 1.3e-14 with AdamW, whose first step divides by |g|); a wrong gradient (a shard lost or counted twice, a rank's gradient missing) is off by
# far more than 1e-10.
BOUND = 1e-10


@dataclass(frozen=True)
class CompileCase:
    name: str
    model: str = "toy"  # "toy" (toy_models.ToyModel: 2 blocks) or "llama" (tiny HF Llama, 1 decoder layer)
    wrapper: str = "fsdp2"  # "fsdp2": fully_shard each compiled block, then the root; "ddp": DDP(model)
    optimizer: str = "sgd"  # "sgd" or "adamw"
    reshard_after_forward: bool = True  # FSDP2's option

    @property
    def blocks(self) -> int:
        """How many decoder blocks (each one tiled gated MLP) the model has: ``blocks_of`` holds them."""
        return 2 if self.model == "toy" else 1


CASES = {case.name: case for case in (
    CompileCase("toy-fsdp2-sgd"),
    CompileCase("toy-fsdp2-adamw-no-reshard", optimizer="adamw", reshard_after_forward=False),
    CompileCase("llama-fsdp2-adamw", model="llama", optimizer="adamw"),
    CompileCase("toy-ddp-sgd", wrapper="ddp"),
)}


def base_model(case: CompileCase) -> nn.Module:
    """The untiled float64 model, the same seeded weights on every rank and in the reference."""
    if case.model == "toy":
        return make_toy_model(seed=0, dtype=torch.float64)
    model = tiny_model("llama", seed=0, dtype=torch.float64)
    # Hugging Face's eager attention takes its softmax in float32: a float64 difference of one ulp in the
    # scores (the tiled sums) can round differently there, and the runs then differ by ~1e-8 (measured).
    # SDPA computes in the input's dtype, so the whole model is float64.
    model.set_attn_implementation("sdpa")
    # One decoder layer: compiling a layer is most of the run's time (~5 s a layer and rank on two cores),
    # and a second identical layer would test nothing more.
    del model.model.layers[1:]
    model.config.num_hidden_layers = 1
    return model


def blocks_of(case: CompileCase, model: nn.Module) -> nn.ModuleList:
    """The decoder blocks, each holding one tiled MLP: what is compiled and sharded one by one."""
    return model.layers if case.model == "toy" else model.model.layers


def batch(case: CompileCase, rank: int, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(input, target) of ``rank`` at ``step``, the same in every run and in the reference."""
    generator = torch.Generator().manual_seed(1000 * (rank + 1) + step)
    if case.model == "toy":
        x = torch.randn(1, TOKENS, HIDDEN, generator=generator, dtype=torch.float64)
        return x, torch.randn(x.shape, generator=generator, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (1, TOKENS), generator=generator)
    return ids, ids


def loss_of(case: CompileCase, model: nn.Module, data: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The mean loss over the batch's tokens, in float64 (Hugging Face's own loss upcasts the logits to
    float32 only, which would bound the comparison at float32's rounding)."""
    x, target = data
    if case.model == "toy":
        return ((model(x) - target) ** 2).mean()
    logits = model(input_ids=x, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), target[:, 1:].reshape(-1))


def make_optimizer(case: CompileCase, params: List[torch.Tensor]) -> torch.optim.Optimizer:
    if case.optimizer == "sgd":
        return torch.optim.SGD(params, lr=LR["sgd"])
    return torch.optim.AdamW(params, lr=LR["adamw"])


def canonical(name: str) -> str:
    """A parameter's name in the plain model: without ``torch.compile``'s ``_orig_mod.`` and DDP's
    ``module.`` (tiling adds nothing to the names)."""
    return name.replace("_orig_mod.", "").removeprefix("module.")


def reference_run(case: CompileCase, world_size: int) -> Dict:
    """The untiled, uncompiled model in one process on the concatenated batches: loss, gradients and
    parameters per step, as the ranks record them."""
    model = base_model(case)
    named = list(model.named_parameters())
    optimizer = make_optimizer(case, [p for _, p in named])
    record: Dict = {"losses": [], "grads": [], "params": [], "initial": {n: p.detach().clone() for n, p in named}}
    for step in range(STEPS):
        parts = [batch(case, rank, step) for rank in range(world_size)]
        data = (torch.cat([x for x, _ in parts]), torch.cat([t for _, t in parts]))
        loss = loss_of(case, model, data)
        loss.backward()
        record["losses"].append(loss.detach().clone())
        record["grads"].append({n: p.grad.detach().clone() for n, p in named})
        optimizer.step()
        optimizer.zero_grad()
        record["params"].append({n: p.detach().clone() for n, p in named})
    return record
