"""What ``apply_tiled_mlp`` did: the blocks it tiled (and with which path), and what it left alone."""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from tiled_mlp.core import TiledMLP
from tiled_mlp.core.builtin_kernels import NormEntry
from tiled_mlp.core.fast_path import structural_decision
from tiled_mlp.core.module_forward import forward_function
from tiled_mlp.strategies.resolver import resolve_strategy

from .norms import TiledNorm


def expected_path(tiled: TiledMLP) -> str:
    """The kernel a ``[batch, tokens, hidden]`` call will take, as far as the forward, the structure and the backend
    decide before the first forward (which also needs the input in the weights' dtype and no autocast)."""
    state = tiled.tiling
    if state.path != "auto":
        return f"{state.path} (requested)"
    strategy = state.fixed_strategy or resolve_strategy(tiled, state.ancestors())
    # A backend that swaps the parameters around its forward (FSDP2, ZeRO-3) holds sharded ones here, not the
    # ones a call computes with: for it the structure alone is reported.
    now = not strategy.swaps_param_storage(tiled)
    spec, why_not = structural_decision(tiled, forward_function(tiled), strategy.is_backend_hook)
    if isinstance(tiled, TiledNorm):
        norm, why_not = NormEntry.spec_for(tiled, strategy, weight_is_local=now)
        if norm is not None:
            return "norm (a registered RMSNorm forward: the norm kernel)"
    if spec is not None:
        view = strategy.local_view(tiled, spec.params) if now else None
        if view is None:
            return "fast (a known gated forward, and the structure fits)"
        if not view.why_not:
            return "fast (a known gated forward, and the structure fits; on each rank's local weights)"
        why_not = view.why_not
    refused = strategy.per_shard_problem(tiled, 2) if now else ""
    if refused:
        return f"refused at the first forward: no built-in kernel runs it (fast: {why_not}; generic: {refused})"
    return f"generic ({why_not})"


def _FREED() -> None:
    return None


class TiledBlock:
    """A block ``apply_tiled_mlp`` tiled, or found tiled. It holds the module weakly: a report outlives its model where
    a long-lived object keeps it (Axolotl's plugin manager keeps its plugins, and so their last report, for the whole
    process), and would keep the deleted model's blocks and their weights."""

    def __init__(self, name: str, kind: str, tiled: TiledMLP) -> None:
        self.name = name
        self.kind = kind  # "gated", "experts", "named", "norm" (norms=True), or "tiled" for a block found already tiled
        self._tiled = weakref.ref(tiled)
        self.mlp_class = type(tiled).__name__
        self.expected_path = expected_path(tiled)

    def __repr__(self) -> str:
        return f"TiledBlock({self.name!r}, {self.kind!r}, {self.mlp_class})"

    def __getstate__(self) -> dict:
        return {**vars(self), "_tiled": self._tiled()}  # pickled with the block (None: freed)

    def __setstate__(self, state: dict) -> None:
        tiled = state["_tiled"]
        self.__dict__.update(state, _tiled=weakref.ref(tiled) if tiled is not None else _FREED)

    @property
    def tiled(self) -> TiledMLP:
        tiled = self._tiled()
        if tiled is None:
            raise ReferenceError(f"tiled-mlp: the block {self.name} this report lists was freed with its model")
        return tiled

    @property
    def last_path(self) -> str:
        """The path the last forward ran: "fast", "norm", "generic", "untiled" (too short to pay), or pending."""
        return self.tiled.tiling.last_path or "pending (decided at the first forward)"


@dataclass
class TilingReport:
    patched: List[TiledBlock] = field(default_factory=list)
    already_tiled: List[TiledBlock] = field(default_factory=list)
    skipped: List[Tuple[str, str]] = field(default_factory=list)
    tiled_loss: str = ""  # the causal LM whose loss the tiled loss now computes, by class name
    loss_left_to: str = ""  # what computes the loss without the logits already (TRL's fused LM head)

    @property
    def blocks(self) -> List[TiledBlock]:
        return self.patched + self.already_tiled

    def paths(self) -> Dict[str, str]:
        """Qualified name -> the path its last forward ran (call after a forward for final answers)."""
        return {block.name: block.last_path for block in self.blocks}

    def __str__(self) -> str:
        norms = sum(block.kind == "norm" for block in self.patched)
        counts = f"{len(self.patched) - norms} MLP block(s)" + (f" and {norms} norm(s)" if norms else "")
        lines = [f"tiled-mlp: tiled {counts}, {len(self.already_tiled)} already tiled, {len(self.skipped)} skipped"]
        for block in self.patched:
            lines.append(f"  tiled   {block.name} ({block.mlp_class}, {block.kind}): {block.expected_path}")
        for block in self.already_tiled:
            lines.append(f"  kept    {block.name} ({block.mlp_class}): already tiled")
        for name, why in self.skipped:
            lines.append(f"  skipped {name}: {why}")
        if self.tiled_loss:
            lines.append(f"  loss    {self.tiled_loss}: tiled LM head + cross-entropy (no logits returned with labels)")
        if self.loss_left_to:
            lines.append(f"  loss    {self.loss_left_to}")
        return "\n".join(lines)
