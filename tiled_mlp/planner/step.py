"""One training step of a decoder model (forward, loss, backward), built from its config and measured.

On the meta device nothing is allocated: a 32-layer 8B model's step takes about a second to model
(more when its MLPs are tiled into many shards); on the CPU with real tensors the same code is the
measured step the planner is checked against (``tests/test_planner_depth.py``,
``tests/test_planner_loss.py``). The memory is the live-storage tracker's, split by kind
(``timeline.py``): weights, gradients, the logits and the loss, other activations.

What a setting tiles is put on by the library's own integration (``apply_tiled_mlp``, with
``loss=True`` for the tiled loss), so the step modelled is the step a user of that call runs.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional, Union

import torch

from . import attention
from .timeline import Timeline, TimelineTracker


@dataclass(frozen=True)
class Setting:
    """How the step runs: tiled MLPs or not, the tiled loss (LM head and cross-entropy a token shard
    at a time, never holding the logits) or the model's own, layers checkpointed or not."""

    tiled: bool
    checkpointing: bool
    num_shards: Union[int, str] = "auto"
    tiled_loss: bool = False
    loss_num_shards: Union[int, str] = "auto"

    @property
    def name(self) -> str:
        """'untiled', 'tiled' (MLPs), 'tiled-loss', 'tiled+tiled-loss', each with '+ckpt' or not: the
        names the plan had before the tiled loss are kept."""
        parts = ["tiled"] if self.tiled else ([] if self.tiled_loss else ["untiled"])
        parts += ["tiled-loss"] if self.tiled_loss else []
        parts += ["ckpt"] if self.checkpointing else []
        return "+".join(parts)


def with_depth(config, depth: int):
    """``config`` with its first ``depth`` decoder layers (per-layer lists cut to match); layer kinds
    chosen by index (``decoder_sparse_step``, ``mlp_only_layers``, ``first_k_dense_replace``) stay
    what they are in the full model."""
    config = copy.deepcopy(config)
    config.num_hidden_layers = depth
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, list):
        config.layer_types = layer_types[:depth]
    config.use_cache = False
    return config


def _dtype_kwargs(dtype: torch.dtype) -> dict:
    """transformers >= 4.56 takes ``dtype`` and warns on ``torch_dtype``; older releases know only the latter."""
    import transformers
    from packaging.version import Version

    return {"dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype": dtype}


def build_model(config, depth: Optional[int], dtype: torch.dtype, device: Union[str, torch.device], setting: Setting,
                seed: int = 0):
    """The causal LM of ``config`` with ``depth`` decoder layers (None: all of them), under ``setting``."""
    from transformers import AutoModelForCausalLM

    from ..integrations import apply_tiled_loss, apply_tiled_mlp

    name = attention.register()
    depth = config.get_text_config().num_hidden_layers if depth is None else depth
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(with_depth(config, depth), attn_implementation=name,
                                                 **_dtype_kwargs(dtype))
    model.train()
    if setting.tiled:
        apply_tiled_mlp(model, num_shards=setting.num_shards, loss=setting.tiled_loss,
                        loss_num_shards=setting.loss_num_shards)
    elif setting.tiled_loss:
        apply_tiled_loss(model, num_shards=setting.loss_num_shards)
    if setting.checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 (the old name warns)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def step_timeline(model, seq: int, batch: int) -> Timeline:
    """The memory timeline of one step of ``model`` on ``batch`` sequences of ``seq`` tokens."""
    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    if device.type != "meta":
        ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    model.zero_grad(set_to_none=True)
    tracker = TimelineTracker(vocab)
    tracker.track_weights(model.parameters())
    with tracker:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        del loss
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    timeline = tracker.timeline(grads)
    model.zero_grad(set_to_none=True)
    return timeline
