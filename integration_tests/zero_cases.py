"""The configurations the ZeRO tests run, and the DeepSpeed config each one needs.

One case is one training setup; every case is trained twice (or three times) from the same seed and
data: untiled, with our TiledMLP, and optionally with DeepSpeed's own TiledMLP as a peer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

HIDDEN = 16  # the toy model's hidden size (integration_tests/toy_models.py)
STEPS = 3  # optimizer steps per run
LR = 0.1  # SGD: updates stay linear in the gradients, so a gradient error shows up in the parameters


@dataclass(frozen=True)
class ZeroCase:
    name: str
    stage: int = 3
    dtype: torch.dtype = torch.float32
    path: str = "auto"  # TiledMLP(path=...)
    gas: int = 1  # gradient accumulation steps
    frozen_input: bool = False  # freeze in_proj and the first norm: the first MLP's input needs no grad
    lora: bool = False  # frozen base weights, trainable adapters (and a frozen first MLP input)
    unequal: bool = False  # ranks see different token counts, and so run different shard counts
    # Each block a ZeRO-3 leaf (``set_z3_leaf_modules``, as LLaMA-Factory marks MoE blocks): the block's hooks
    # gather its whole subtree, and none run on the tiled MLP inside it.
    leaf_blocks: bool = False
    num_shards: Union[int, str] = 3
    # num_shards="auto" with these token counts per rank, and the shard counts "auto" must pick.
    auto_tokens: Tuple[int, int] = ()
    auto_shards: Tuple[int, int] = ()
    # The auto policy's floor on the bytes tiling must save (``auto_shards.MIN_SAVED_BYTES``), where the
    # toy MLP is far below the real one and the case is about two ranks deciding differently.
    min_saved_bytes: Optional[int] = None

    def tokens(self, rank: int) -> int:
        if self.auto_tokens:
            return self.auto_tokens[rank % 2]
        return (19, 41)[rank % 2] if self.unequal else 24

    def shards(self, rank: int) -> Union[int, str]:
        # Unequal: different token counts *and* different shard counts on the two ranks, fixed here
        # rather than left to the "auto" policy so the test keeps meaning the same.
        if self.auto_tokens:
            return "auto"
        return (2, 3)[rank % 2] if self.unequal else self.num_shards

    def expected_shards(self, rank: int) -> int:
        return self.auto_shards[rank % 2] if self.auto_tokens else self.shards(rank)


def zero_ds_config(case: ZeroCase) -> dict:
    zero = {"stage": case.stage}
    if case.stage == 3:
        # Without it the toy model's small parameters would stay whole and nothing would be gathered.
        zero.update(stage3_param_persistence_threshold=0)
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": case.gas,
        "zero_optimization": zero,
        "bf16": {"enabled": case.dtype == torch.bfloat16},
        "zero_allow_untested_optimizer": True,  # a plain torch SGD
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def zero_tolerance(case: ZeroCase) -> Tuple[float, float]:
    """(relative, absolute) bound on |tiled - untiled| against the largest entry of the untiled value.

    fp32: the tiled run sums the same products in another order (shards), ~1e-7 relative.
    bf16: both runs round every matmul output to bf16 (8 bits of mantissa) at different points; a
    wrong or missing shard would be off by tens of percent.
    """
    return (1e-5, 1e-7) if case.dtype == torch.float32 else (3e-2, 1e-4)


# Grouped so that one spawned pair of processes (5-10 s to start with DeepSpeed) runs several cases.
GROUPS = {
    "zero3-fp32-generic": (
        ZeroCase("z3-generic", path="generic"),
        ZeroCase("z3-generic-gas2", path="generic", gas=2),
        ZeroCase("z3-generic-frozen-input", path="generic", frozen_input=True),
        ZeroCase("z3-lora", lora=True),  # LoRA projections: "auto" takes the generic path
        ZeroCase("z3-generic-unequal", path="generic", unequal=True),
    ),
    "zero3-fp32-fast": (
        ZeroCase("z3-fast", path="fast"),
        ZeroCase("z3-fast-gas2", path="fast", gas=2),
        ZeroCase("z3-fast-frozen-input", path="fast", frozen_input=True),
        ZeroCase("z3-fast-unequal", path="fast", unequal=True),
        # "auto" on 8 tokens would run the MLP untiled (too short to pay), on 2500 tokens tiled: under
        # ZeRO-3 the two would gather differently and deadlock, so the short rank tiles in one shard.
        ZeroCase("z3-auto-short-and-long-rank", path="fast", auto_tokens=(8, 2500), auto_shards=(1, 3),
                 min_saved_bytes=0),
    ),
    "zero3-bf16": (
        ZeroCase("z3-bf16-generic", dtype=torch.bfloat16, path="generic"),
        ZeroCase("z3-bf16-lora-gas2-unequal", dtype=torch.bfloat16, lora=True, gas=2, unequal=True),
        ZeroCase("z3-bf16-fast-frozen-input", dtype=torch.bfloat16, path="fast", frozen_input=True),
    ),
    "zero3-leaf-blocks": (
        ZeroCase("z3-leaf-fast", path="fast", leaf_blocks=True),
        ZeroCase("z3-leaf-generic-gas2", path="generic", gas=2, leaf_blocks=True),
    ),
    "zero1-zero2-fp32": tuple(
        ZeroCase(f"z{stage}-{variant}", stage=stage, **kwargs)
        for stage in (1, 2)
        for variant, kwargs in (
            ("generic-gas2", dict(path="generic", gas=2)),
            ("lora-frozen-input", dict(lora=True)),
            ("fast-unequal", dict(path="fast", unequal=True)),
        )
    ),
}
# DeepSpeed's TiledMLP needs the same shard count on every rank (its docstring all-reduces it), so
# it gets no unequal case.
PEER_CASES = (
    ZeroCase("z3-generic", path="generic"),
    ZeroCase("z3-generic-gas2", path="generic", gas=2),
    ZeroCase("z3-generic-frozen-input", path="generic", frozen_input=True),
    ZeroCase("z3-lora", lora=True),
    ZeroCase("z2-generic", stage=2, path="generic"),
)
