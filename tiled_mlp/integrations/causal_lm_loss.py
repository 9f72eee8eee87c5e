"""Hugging Face causal LMs: route the loss through the tiled loss, so the logits are never held.

A causal LM's forward computes ``logits = lm_head(hidden)`` over every token, then
``loss_function(logits, labels)``: at 131072 tokens and a 128K vocabulary those logits and the loss's
copies of them are most of a checkpointed step's peak. ``install_tiled_loss(model)`` puts a forward on the
model *instance* (``model.forward``; no class is swapped, no module added, so every parameter name,
``state_dict`` key and adapter key stays) that, when labels are given:

1. runs the model's own forward with ``labels=None`` and an empty ``logits_to_keep``: everything the
   model computes (the decoder, gradient checkpointing, a MoE router's auxiliary loss) is its own code,
   and ``lm_head`` runs on zero tokens;
2. takes the decoder's final hidden states (a forward hook on ``model.get_decoder()``, removed after);
3. returns the model's output with ``loss = tiled_cross_entropy(hidden, model.lm_head, labels, ...)``
   (plus ``router_aux_loss_coef * aux_loss`` for the MoE families, as their forward adds it) and no
   ``logits``.

Without labels, or without a graph being built (evaluation: ``Trainer.evaluate`` with metrics reads the
logits), the model's forward runs unchanged, logits included.

Which models: the families whose forward is known to compute exactly ``lm_head`` -> (soft-capping) ->
``loss_function`` (``KNOWN_FORMS``), decided by what the model *is*: its class and that class's forward
function are those of the installed transformers. A model whose class forward was replaced (another
library's loss patch) or that set its own ``loss_function`` is refused: its loss would silently change.
"""
from __future__ import annotations

import copy
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn

from tiled_core import tiled_cross_entropy
from tiled_core.shard_plan import NumShards


@dataclass(frozen=True)
class LossForm:
    """What a family's forward does between the decoder and the loss."""

    softcap_attr: Optional[str] = None  # config attribute of the logit soft-capping (Gemma 2, 3)
    router_aux_loss: bool = False  # adds ``router_aux_loss_coef * aux_loss`` to the loss (MoE)


_PLAIN, _SOFTCAP, _MOE = LossForm(), LossForm(softcap_attr="final_logit_softcapping"), LossForm(router_aux_loss=True)
KNOWN_FORMS: Dict[Tuple[str, str], LossForm] = {
    ("transformers.models.llama.modeling_llama", "LlamaForCausalLM"): _PLAIN,
    ("transformers.models.mistral.modeling_mistral", "MistralForCausalLM"): _PLAIN,
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2ForCausalLM"): _PLAIN,
    ("transformers.models.qwen3.modeling_qwen3", "Qwen3ForCausalLM"): _PLAIN,
    ("transformers.models.phi3.modeling_phi3", "Phi3ForCausalLM"): _PLAIN,
    ("transformers.models.gemma.modeling_gemma", "GemmaForCausalLM"): _PLAIN,
    ("transformers.models.gemma2.modeling_gemma2", "Gemma2ForCausalLM"): _SOFTCAP,
    ("transformers.models.gemma3.modeling_gemma3", "Gemma3ForCausalLM"): _SOFTCAP,
    ("transformers.models.mixtral.modeling_mixtral", "MixtralForCausalLM"): _MOE,
    ("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeForCausalLM"): _MOE,
    ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeForCausalLM"): _MOE,
}


def _family_class(module: nn.Module) -> Optional[type]:
    """The class in ``module``'s MRO that ``KNOWN_FORMS`` names (a subclass, FSDP2's wrapper class), if any."""
    return next((k for k in type(module).__mro__ if (k.__module__, k.__qualname__) in KNOWN_FORMS), None)


def known_form(model: nn.Module) -> Tuple[Optional[LossForm], str]:
    """(the family's form, "") when ``model`` is a known causal LM with its library forward, else (None, why)."""
    klass = _family_class(model)
    if klass is None:
        names = ", ".join(sorted(name for _, name in KNOWN_FORMS))
        return None, f"{type(model).__name__} is not one of the causal LMs whose loss path is known ({names})"
    name = klass.__qualname__
    if getattr(importlib.import_module(klass.__module__), name, None) is not klass:
        return None, f"{name} is not the class transformers defines"
    forward = type(model).forward
    own = (getattr(forward, "__module__", None) == klass.__module__
           and getattr(forward, "__qualname__", None) == f"{name}.forward")
    if not own:  # a forward put on the class since (Liger's loss patch): not the one this form describes
        return None, (f"{type(model).__name__}.forward is not {name}'s own (another library patched it); its loss "
                      "could change silently")
    if "_loss_function" in vars(model):
        return None, "it sets its own loss_function, which the tiled loss would replace"
    return KNOWN_FORMS[(klass.__module__, name)], ""


class TiledLossForward:
    """The forward installed on a causal LM instance (see the module docstring). Picklable and
    deep-copyable with the model (it holds the model and its settings, nothing else). Under sequence
    parallelism (``ulysses.py``) it also holds the group its loss is divided over: a deep copy shares
    that group (a process-wide handle), and pickling refuses it (a group cannot leave its process).
    """

    def __init__(self, model: nn.Module, form: LossForm, previous: Optional[Callable], num_shards: NumShards,
                 grad_accum_dtype: Optional[torch.dtype]):
        self.model: Any = model  # a transformers PreTrainedModel (get_decoder, config, ...)
        self.form = form
        self.previous = previous  # an instance forward the model had before (None: its class's)
        self.num_shards = num_shards
        self.grad_accum_dtype = grad_accum_dtype
        self.sequence_group: Any = None  # set by apply_sequence_parallel

    def __deepcopy__(self, memo: dict) -> TiledLossForward:
        clone = object.__new__(type(self))
        memo[id(self)] = clone  # the model's copy refers back to this forward's copy, not to a second one
        group, self.sequence_group = self.sequence_group, None
        try:
            copied = copy.deepcopy(vars(self), memo)
        finally:
            self.sequence_group = group
        clone.__dict__.update(copied, sequence_group=group)
        return clone

    def __getstate__(self) -> dict:
        if self.sequence_group is not None:
            raise TypeError("tiled loss: a model under sequence parallelism cannot be pickled (its process group "
                            "cannot leave this process); remove sequence parallelism first (.remove())")
        return dict(vars(self))

    def _inner(self) -> Callable:
        return self.previous if self.previous is not None else type(self.model).forward.__get__(self.model)

    @property
    def __signature__(self) -> inspect.Signature:
        # The Trainer reads the model's forward signature (label columns, ``**kwargs`` for
        # ``num_items_in_batch``): the model's own.
        return inspect.signature(self._inner())

    def __call__(self, *args, **kwargs):
        inner = self._inner()
        arguments = inspect.signature(inner).bind(*args, **kwargs).arguments
        extra = dict(arguments.pop("kwargs", {}))
        labels = arguments.get("labels")
        if (labels is None and extra.get("shift_labels") is None) or (
                not torch.is_grad_enabled() and self.sequence_group is None):
            # No labels, or no graph (evaluation: a Trainer's metrics read the logits, and no backward
            # will hold them): the model's own forward, logits included. Not under sequence parallelism:
            # there a rank's logits are a slice and the model's loss a slice's mean, so evaluation takes
            # the tiled loss too, divided once over the group.
            return inner(*args, **kwargs)
        keep = arguments.get("logits_to_keep", 0)
        if not (isinstance(keep, int) and keep == 0):
            raise ValueError("tiled loss: labels were given with logits_to_keep; the loss is computed over every "
                             "token. Drop logits_to_keep, or remove the tiled loss (remove_tiled_loss)")
        return_dict = extra.pop("return_dict", None)
        arguments.update(labels=None, logits_to_keep=torch.empty(0, dtype=torch.long))
        hidden: Dict[str, torch.Tensor] = {}
        handle = self.model.get_decoder().register_forward_hook(
            lambda _m, _a, out: hidden.__setitem__("h", out[0] if isinstance(out, tuple) else out.last_hidden_state))
        try:
            out = inner(**arguments, **extra, return_dict=True)
        finally:
            handle.remove()
        softcap = getattr(self.model.config, self.form.softcap_attr) if self.form.softcap_attr else None
        loss = tiled_cross_entropy(
            hidden["h"], self.model.get_output_embeddings(), labels, shift_labels=extra.get("shift_labels"),
            ignore_index=extra.get("ignore_index", -100), num_items_in_batch=extra.get("num_items_in_batch"),
            logit_softcap=softcap, num_shards=self.num_shards, grad_accum_dtype=self.grad_accum_dtype,
            sequence_group=self.sequence_group, model=self.model)
        if self.form.router_aux_loss and getattr(out, "aux_loss", None) is not None:
            loss = loss + self.model.router_aux_loss_coef * out.aux_loss.to(loss.device)
        fields: Dict[str, Any] = {k: v for k, v in out.items() if k not in ("loss", "logits")}
        result = type(out)(loss=loss, **fields)
        return result if return_dict is not False else result.to_tuple()


def find_causal_lm(model: nn.Module) -> Optional[nn.Module]:
    """The causal LM inside ``model`` (itself, or under a PEFT or other wrapper): the first module whose
    class is of a known family."""
    return next((module for module in model.modules() if _family_class(module) is not None), None)


def check_tiled_loss(model: nn.Module) -> Tuple[nn.Module, LossForm]:
    """Every check before installing; returns (the causal LM, its form)."""
    causal_lm = find_causal_lm(model)
    if causal_lm is None:
        _, why = known_form(model)
        raise TypeError(f"tiled loss: no known causal LM in {type(model).__name__}: {why}")
    if isinstance(vars(causal_lm).get("forward"), TiledLossForward):
        return causal_lm, vars(causal_lm)["forward"].form
    form, why = known_form(causal_lm)
    if form is None:
        raise TypeError(f"tiled loss cannot be put on {type(causal_lm).__name__}: {why}")
    return causal_lm, form


def install_tiled_loss(model: nn.Module, num_shards: NumShards = "auto",
                       grad_accum_dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Put the tiled loss on the causal LM in ``model``; returns that causal LM. Installing twice keeps
    the first (its settings included)."""
    causal_lm, form = check_tiled_loss(model)
    if not is_tiled_loss(causal_lm):
        previous = vars(causal_lm).get("forward")
        causal_lm.__dict__["forward"] = TiledLossForward(causal_lm, form, previous, num_shards, grad_accum_dtype)
    return causal_lm


def tiled_loss_forward(model: nn.Module) -> Optional[TiledLossForward]:
    """The tiled loss installed on the causal LM in ``model``, if any."""
    causal_lm = find_causal_lm(model)
    installed = vars(causal_lm).get("forward") if causal_lm is not None else None
    return installed if isinstance(installed, TiledLossForward) else None


def is_tiled_loss(model: nn.Module) -> bool:
    return tiled_loss_forward(model) is not None


def remove_tiled_loss(model: nn.Module) -> bool:
    """Put the model's own forward back; False where no tiled loss was installed."""
    causal_lm = find_causal_lm(model)
    if causal_lm is None:
        return False
    installed = vars(causal_lm).get("forward")
    if not isinstance(installed, TiledLossForward):
        if any(isinstance(getattr(installed, name, None), TiledLossForward) for name in ("__wrapped__", "func")):
            raise RuntimeError("tiled loss: the model's forward was wrapped again after the tiled loss was installed "
                               "(accelerate's hooks?); remove that wrapper first")
        return False
    if installed.previous is not None:
        causal_lm.__dict__["forward"] = installed.previous
    else:
        del causal_lm.__dict__["forward"]
    return True
