"""Ulysses sequence parallelism in the modelled step: DeepSpeed's own ``UlyssesSPAttentionHF`` around the
planner's causal attention (``attention.py``), as ALST runs it.

A rank of an SP group of ``sp`` runs ``seq / sp`` tokens through everything but the attention; there
DeepSpeed's class exchanges q, k and v (all-to-all) from [its tokens, all heads] to [all tokens,
heads / sp] (key/value heads repeated first when ``sp`` exceeds them), gathers the position ids, runs
the core attention over the whole sequence, and exchanges the output back. Every buffer of that (its
rearranges and contiguous copies, the exchanges' outputs, the gathered position ids) is what the class
itself allocates: the modelled step runs the class, not a copy of it.

On the meta device, in one process: DeepSpeed's collectives go through ``deepspeed.comm``, whose backend
object (``deepspeed.comm.comm.cdb``) is swapped, while a modelled step runs and nowhere else, for a
stand-in (``meta_comm``) that answers a planner-owned group's size and rank (``MetaGroup``, rank 0) and
makes the position ids' all-gather a no-op (a meta tensor has no values to exchange; the list it fills
is allocated by the class before the call). The all-to-all is DeepSpeed's operator
``deepspeed::dim_zero_all_to_all``, whose registered fake kernel (``empty_like``) is what runs on meta:
the allocation of the real exchange's output. torch.distributed's default process group is never touched.
A real step passes its real group instead (``integration_tests/test_planner_sp_honesty.py``: two gloo
ranks, byte-exact against the modelled step).

The attention is registered with transformers under a name of its own per model, as DeepSpeed's
``register_with_transformers`` does with its wrapper (which drops the mask transformers built for the
local slice), but without replacing an existing name's function: plans of other settings in the same
process keep theirs.
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Any, Iterator

from . import attention
from .heads import check_degree, head_counts

_NAMES = itertools.count()


class MetaGroup:
    """Stands in for the SP process group of the modelled rank: rank 0 of ``size``."""

    def __init__(self, size: int):
        self._size = size
        self.group_name = f"tiled_mlp_planner_sp{size}"

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


class _MetaComm:
    """``deepspeed.comm``'s backend while a modelled step runs: questions about a ``MetaGroup`` are answered
    here; any other group's go to the backend that was there, if any."""

    using_mpi = False

    def __init__(self, previous: Any):
        self._previous = previous

    def is_initialized(self) -> bool:
        return True

    def get_world_size(self, group: Any = None) -> int:
        return group.size() if isinstance(group, MetaGroup) else self._before().get_world_size(group)

    def get_rank(self, group: Any = None) -> int:
        return group.rank() if isinstance(group, MetaGroup) else self._before().get_rank(group)

    def all_gather(self, tensor_list, tensor, group: Any = None, async_op: bool = False) -> Any:
        if isinstance(group, MetaGroup):
            return None  # meta tensors: the list is allocated already, there are no values to exchange
        return self._before().all_gather(tensor_list=tensor_list, tensor=tensor, group=group, async_op=async_op)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._before(), name)

    def _before(self) -> Any:
        if self._previous is None:
            raise RuntimeError("the planner's stand-in for deepspeed.comm answers only for its own MetaGroup, and no "
                               "DeepSpeed backend was initialized before it")
        return self._previous


@contextlib.contextmanager
def meta_comm() -> Iterator[None]:
    """DeepSpeed's collectives answered for ``MetaGroup``s, for the duration of the block."""
    import deepspeed.comm.comm as ds_comm

    previous = ds_comm.cdb
    ds_comm.cdb = _MetaComm(previous)
    try:
        yield
    finally:
        ds_comm.cdb = previous


def comm_for(group: Any) -> contextlib.AbstractContextManager:
    """The context a step of a model whose SP group is ``group`` runs in."""
    return meta_comm() if isinstance(group, MetaGroup) else contextlib.nullcontext()


def check(config, sp: int) -> None:
    """A ValueError when ``sp`` ranks cannot share the heads of ``config`` as DeepSpeed's class needs."""
    check_degree("--sp", sp, "sequence")
    if sp == 1:
        return
    from ..integrations.ulysses import shares_heads

    heads, kv_heads = head_counts(config)
    queries_shared, kv_shared = shares_heads(heads, kv_heads, sp)
    if not queries_shared:
        raise ValueError(f"--sp {sp}: {config.model_type} has {heads} query heads, which {sp} ranks cannot share "
                         f"(Ulysses gives each rank whole heads: heads / sp); give an --sp that divides {heads}")
    if not kv_shared:
        raise ValueError(f"--sp {sp}: {config.model_type} has {kv_heads} key/value heads; {sp} ranks must divide them "
                         "or be a multiple of them (DeepSpeed repeats each key/value head sp / kv_heads times)")


def refusal(model) -> str:
    """Why ``apply_sequence_parallel`` refuses ``model`` ('' when it takes it), asked of the library's own
    checks that need no process group: the tiled loss must go on the model (``check_tiled_loss``; the SP
    loss is its cross-rank sum), and a router auxiliary loss (MoE) is refused there."""
    from ..integrations.causal_lm_loss import check_tiled_loss

    try:
        causal_lm, form = check_tiled_loss(model)
    except TypeError as error:
        return f"apply_sequence_parallel needs the tiled loss, and {error}"
    if form.router_aux_loss:
        return (f"apply_sequence_parallel refuses {type(causal_lm).__name__}: its router auxiliary loss is not a sum "
                "over tokens and is not reduced across the SP ranks (MoE models are not supported)")
    return ""


def load_deepspeed() -> None:
    """DeepSpeed's Ulysses attention imported, and its accelerator chosen, in this process: what DeepSpeed
    logs then ("Setting accelerator to CPU") is logged once, here, and not again by each worker forked
    after (``workers.py``), which inherits both."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF  # noqa: F401

    get_accelerator()


def register(config, sp: int, batch: int, group: Any) -> str:
    """DeepSpeed's ``UlyssesSPAttentionHF`` of ``sp`` ranks around the planner's causal attention, registered
    with transformers under a new name (returned), for ``batch`` sequences per step (the class fixes it)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers import AttentionInterface

    check(config, sp)
    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    with comm_for(group):
        ulysses = UlyssesSPAttentionHF(attention.causal_attention, batch_size=batch, attn_head_count=heads,
                                       attn_head_size=head_dim,
                                       kv_head_count=getattr(text, "num_key_value_heads", None) or heads,
                                       num_hidden_layers=text.num_hidden_layers, process_group=group,
                                       seq_length_is_variable=True)
    if ulysses.world_size != sp:
        raise ValueError(f"sequence parallelism of {sp} ranks on a process group of {ulysses.world_size}")

    def wrapper(module, query, key, value, attention_mask, *args, **kwargs):
        # DeepSpeed's own wrapper (``register_with_transformers``): the mask transformers made is for the
        # local slice and is dropped; causality comes from the kernel and the gathered position ids.
        return ulysses(module, query, key, value, None, *args, **kwargs)

    name = f"{attention.NAME}_ulysses_sp{sp}_{next(_NAMES)}"
    AttentionInterface.register(name, wrapper)
    return name
