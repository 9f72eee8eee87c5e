"""One training step of a decoder model (forward, loss, backward), built from its config and measured.

On the meta device nothing is allocated: a 32-layer 8B model's step takes about a second to model
(more when its MLPs are tiled into many shards); on the CPU with real tensors the same code is the
measured step the planner is checked against (``tests/planner/test_planner_depth.py``,
``tests/planner/test_planner_loss.py``). The memory is the live-storage tracker's, split by kind
(``timeline.py``): weights, gradients, the logits and the loss, other activations.

What a setting tiles is put on by the library's own integration (``apply_tiled_mlp``, with
``loss=True`` for the tiled loss and ``norms=True`` for the RMSNorms), so the step modelled is the step a user of that call runs; checkpoint
offload likewise (``apply_checkpoint_offload``: its host copies are counted as host memory, and so are
the CPU generator states the generic tiled path saves per shard, ``rng_states.py``). Under
Ulysses sequence parallelism the step is one rank's: ``seq / sp`` tokens, DeepSpeed's attention class
around the core attention (``sequence_parallel.py``), the position ids given as DeepSpeed's data-loader
adapter gives them.
"""
from __future__ import annotations

import contextlib
import copy
import weakref
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple, Union

import torch

from . import attention, sequence_parallel, tensor_parallel
from .rng_states import generator_states_shown
from .shard_replay import shards_replayed
from .timeline import Event, Timeline, TimelineTracker

# What ``build_model`` put on a model beyond transformers' build, by model (side tables: the model itself
# stays what transformers made): its checkpoint offload, and its SP group.
_OFFLOADS: weakref.WeakKeyDictionary[torch.nn.Module, Any] = weakref.WeakKeyDictionary()
_SP_GROUPS: weakref.WeakKeyDictionary[torch.nn.Module, Any] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Setting:
    """How the step runs: tiled MLPs or not, the tiled loss (LM head and cross-entropy a token shard
    at a time, never holding the logits) or the model's own, layers checkpointed or not, their inputs
    offloaded to the host or not, the Ulysses SP degree (each rank runs ``seq / sp`` tokens), and the
    RMSNorms tiled or not (``apply_tiled_mlp(norms=True)``: a norm keeps only its input, with
    ``num_shards`` shards a call, where Hugging Face's keeps float32 ``[tokens, hidden]`` copies)."""

    tiled: bool
    checkpointing: bool
    num_shards: Union[int, str] = "auto"
    tiled_loss: bool = False
    loss_num_shards: Union[int, str] = "auto"
    offload_checkpoints: bool = False
    sp: int = 1
    tiled_norms: bool = False
    tp: int = 1  # tensor parallelism: the rank holds its share of each layer (``tensor_parallel.py``)

    def __post_init__(self) -> None:
        if self.offload_checkpoints and not self.checkpointing:
            raise ValueError("checkpoint offload moves the input each checkpointed layer keeps for its backward to "
                             "host memory; without layer checkpointing there is no such input: turn checkpointing on")
        if isinstance(self.sp, bool) or not isinstance(self.sp, int) or self.sp < 1:
            raise ValueError(f"sequence parallelism of {self.sp!r} ranks: give a whole number, 1 or more")
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tensor parallelism of {self.tp!r} ranks: give a whole number, 1 or more")
        if self.tp > 1 and self.sp > 1:
            raise ValueError(f"tensor parallelism ({self.tp} ranks) with Ulysses sequence parallelism ({self.sp}) is "
                             "not modelled: give one of them")

    @property
    def name(self) -> str:
        """'untiled', 'tiled' (MLPs), 'tiled-loss', 'tiled+tiled-loss', then '+norms' (tiled RMSNorms)
        where they are on, each with '+ckpt' or not, then '+offload' (checkpoint offload) and '+spN'
        (Ulysses over N ranks) where they are on: a setting with none of those parts is named by its tiling
        and checkpointing alone."""
        parts = ["tiled"] if self.tiled else ([] if self.tiled_loss or self.tiled_norms else ["untiled"])
        parts += ["tiled-loss"] if self.tiled_loss else []
        parts += ["norms"] if self.tiled_norms else []
        parts += ["ckpt"] if self.checkpointing else []
        parts += ["offload"] if self.offload_checkpoints else []
        parts += [f"sp{self.sp}"] if self.sp > 1 else []
        parts += [f"tp{self.tp}"] if self.tp > 1 else []
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
                seed: int = 0, batch: int = 1, sp_group: Any = None, attention_choice: Optional[str] = None,
                tp_mesh: Any = None):
    """The causal LM of ``config`` with ``depth`` decoder layers (None: all of them), under ``setting``,
    running ``attention_choice`` (``attention.CHOICES``; None: what transformers picks for the config).
    With ``setting.sp > 1``: for ``batch`` sequences a step, on ``sp_group`` (a real process group of
    ``sp`` ranks; None: the planner's stand-in, on the meta device only). With ``setting.tp > 1``: torchtitan's TP
    plan put on it over ``tp_mesh`` (a real 1-D mesh of ``tp`` ranks; None: the planner's, on the meta device only)."""
    from transformers import AutoModelForCausalLM

    from ..integrations import apply_checkpoint_offload, apply_tiled_loss, apply_tiled_mlp
    from ..integrations.offload import checkpointing_on

    if setting.sp > 1:
        if sp_group is None:
            if torch.device(device).type != "meta":
                raise ValueError("a real step under sequence parallelism needs its process group (sp_group)")
            sp_group = sequence_parallel.MetaGroup(setting.sp)
        name = sequence_parallel.register(config, setting.sp, batch, sp_group)
    else:
        name = attention.register(attention_choice or attention.default_for(config)[0])
    depth = config.get_text_config().num_hidden_layers if depth is None else depth
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(with_depth(config, depth), attn_implementation=name,
                                                 **_dtype_kwargs(dtype))
    model.train()
    if setting.tp > 1:
        # The TP plan first, the tiling on top of it: the order the library takes them in (the tiled MLP's
        # fast kernel and the vocabulary-parallel tiled loss find the styles' hooks on the Linears).
        tensor_parallel.check(config, setting.tp)
        if tp_mesh is None:
            if torch.device(device).type != "meta":
                raise ValueError("a real step under tensor parallelism needs its device mesh (tp_mesh)")
            tp_mesh = tensor_parallel.meta_mesh(setting.tp)
        if tp_mesh.size() != setting.tp:
            raise ValueError(f"tensor parallelism of {setting.tp} ranks on a mesh of {tp_mesh.size()}")
        tensor_parallel.apply(model, tp_mesh)
    if setting.tiled or setting.tiled_norms:
        # No MLP is included where only the norms are tiled (an empty include selects no block).
        apply_tiled_mlp(model, num_shards=setting.num_shards, include=None if setting.tiled else [],
                        loss=setting.tiled_loss, loss_num_shards=setting.loss_num_shards, norms=setting.tiled_norms)
    elif setting.tiled_loss:
        apply_tiled_loss(model, num_shards=setting.loss_num_shards)
    if setting.checkpointing:
        checkpointing_on(model)
    if setting.offload_checkpoints:
        _OFFLOADS[model] = apply_checkpoint_offload(model)
    if setting.sp > 1:
        _SP_GROUPS[model] = sp_group
    return model


def step_timeline(model, seq: int, batch: int, rank: int = 0, describe: bool = False,
                  replay_shards: bool = True) -> Timeline:
    """The memory timeline of one step of ``model`` on ``batch`` sequences of ``seq`` tokens: under
    sequence parallelism, the ``seq`` tokens of SP rank ``rank``. ``describe``: with what made each
    allocation (``Timeline.at_peak``). ``replay_shards``: on the meta device, same-size shards of a
    tiled call modelled once and logged again (``shard_replay.py``); False runs every shard."""
    tracker, events = _run_step(model, seq, batch, rank, describe, replay_shards)
    return tracker.timeline(events)


def step_sections(model, seq: int, batch: int, describe: bool = False, replay_shards: bool = True) -> List[List[Event]]:
    """One step's log in three sections: the weights' tracking, the forward (with the loss), the
    backward (``compose.py`` puts a deep step together from shallow ones, section by section)."""
    tracker, events = _run_step(model, seq, batch, 0, describe, replay_shards)
    return tracker.sections(events)


def _run_step(model, seq: int, batch: int, rank: int, describe: bool,
              replay_shards: bool = True) -> Tuple[TimelineTracker, List[Event]]:
    """The step run under a tracker, and its log as events, taken while the gradients are still alive."""
    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    parallel = tensor_parallel.is_parallel(model)
    # Under TP the rank's logits are its share of the vocabulary: what marks a tensor as the logits' kind.
    vocab_seen = tensor_parallel.local_vocab(model) if parallel else vocab
    ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
    if device.type != "meta":
        ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(rank)).to(device)
    inputs = dict(input_ids=ids, labels=ids)
    group = _SP_GROUPS.get(model)
    if group is not None:
        # Ulysses needs every rank's positions (it gathers them): DeepSpeed's data-loader adapter hands each
        # rank its slice, made before the step like the ids.
        first = rank * seq
        inputs["position_ids"] = torch.arange(first, first + seq, device=device).unsqueeze(0).repeat(batch, 1)
    offload = _OFFLOADS.get(model)
    model.zero_grad(set_to_none=True)
    tracker = TimelineTracker(vocab_seen, describe)
    if parallel and next(model.parameters()).is_meta:
        tracker.device_answers = tensor_parallel.device_answers()
    tracker.track_weights(model.parameters())
    tracker.mark()
    comm = sequence_parallel.comm_for(group) if group is not None else contextlib.nullcontext()
    tp_context = tensor_parallel.step_context(model) if parallel else contextlib.nullcontext()
    try:
        if offload is not None:
            offload.on_host_copy = tracker.track_host
        # A CPU step is measured: every shard runs.
        replay = shards_replayed(tracker) if replay_shards and device.type == "meta" else contextlib.nullcontext()
        with comm, tp_context, attention.positions_read(), generator_states_shown(tracker.track_generator_state), replay, tracker:
            loss = model(**inputs).loss
            tracker.mark()
            loss.backward()
            del loss
    finally:
        if offload is not None:
            offload.on_host_copy = None
    events = tracker.kinded([p.grad for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return tracker, events


def offload_of(model) -> Any:
    """The checkpoint offload ``build_model`` put on ``model`` (None: none)."""
    return _OFFLOADS.get(model)
