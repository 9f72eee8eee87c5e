"""Hugging Face causal LMs: the loss through the tiled loss, the logits never held (docs/long-context-stack.md,
"Tiled loss"). ``install_tiled_loss`` puts a ``TiledLossForward`` on the model *instance*; what installing cannot
see (a loss function or a forward set since) a forward pre-hook checks at every call, before any work. The
forward may sit inside accelerate's wrappers or TRL's head: ``forward_layers`` reads that chain, in one place.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import logging
import types
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple, cast

import torch
import torch.distributed as dist
from torch import nn

from tiled_mlp.core import dynamo_support, tiled_cross_entropy
from tiled_mlp.core.kernels.cross_entropy import CrossEntropyOptions
from tiled_mlp.core.shard_plan import NumShards, check_num_shards
from tiled_mlp.core.tiled_loss import loss_as_op

from .accelerate_forward import (
    DeviceHookForward,
    MixedPrecisionForward,
    device_hook_forward,
    head_device_hook_refusal,
    hook_like_add_hook,
    mixed_precision_forward,
    wrap_like_prepare,
)
from .trl_seam import FusedHead, fused_head

logger = logging.getLogger(__name__)


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


def find_causal_lm(model: nn.Module) -> Optional[nn.Module]:
    """The causal LM inside ``model`` (itself, or under a PEFT or other wrapper)."""
    return next((module for module in model.modules() if _family_class(module) is not None), None)


@dataclass(frozen=True)
class ForwardLayers:
    """The wrappers on a causal LM's forward, outermost first (None where absent), and the forward inside them
    (None: the class's). The order in which TRL's trainers, ``Accelerator.prepare`` and ``dispatch_model`` add them."""

    mixed_precision: Optional[MixedPrecisionForward]
    trl_head: Optional[FusedHead]
    device_hook: Optional[DeviceHookForward]
    forward: Optional[Callable]

    def under(self) -> str:
        around = [name for name, present in (("accelerate's device hook", self.device_hook),
                                             (self.trl_head.describe() if self.trl_head else "", self.trl_head),
                                             ("accelerate's mixed precision", self.mixed_precision)) if present]
        return f", inside {', inside '.join(around)}" if around else ""


def forward_layers(causal_lm: nn.Module) -> ForwardLayers:
    wrapped = mixed_precision_forward(causal_lm)
    forward = wrapped.inner if wrapped is not None else vars(causal_lm).get("forward")
    trl_head = fused_head(forward)
    if trl_head is not None:
        forward = trl_head.inner
    hooked = device_hook_forward(causal_lm, forward) if forward is not None else None
    return ForwardLayers(wrapped, trl_head, hooked, hooked.inner if hooked is not None else forward)


def _is_class_forward(model: nn.Module, forward: Any) -> bool:
    return (isinstance(forward, types.MethodType) and forward.__self__ is model
            and forward.__func__ is type(model).forward)


def describe_forward(thing: Any) -> str:
    """Where a forward was defined, read from its code and globals: ``functools.wraps`` copies another
    function's names onto a wrapper, its code keeps its own."""
    function = thing.__func__ if isinstance(thing, types.MethodType) else thing
    if isinstance(function, functools.partial):
        return f"functools.partial of {describe_forward(function.func)}"
    code = getattr(function, "__code__", None)
    if code is None:  # a callable object: its class
        return f"a {type(function).__module__}.{type(function).__qualname__} object"
    module = getattr(function, "__globals__", {}).get("__name__", "?")
    qualname = getattr(code, "co_qualname", None)  # Python 3.11+; before it, the code's bare name
    defined = f"{module}.{qualname or code.co_name}"
    shown_module = getattr(function, "__module__", module)
    shown = getattr(function, "__qualname__", "?")
    renamed = shown_module != module or (shown != qualname if qualname else getattr(function, "__name__", "") != code.co_name)
    if renamed:
        return f"{defined}, which carries the name {shown_module}.{shown} (functools.wraps)"
    return defined


def class_forward_refusal(model: nn.Module) -> str:
    """Why the forward ``model``'s class has stops the tiled loss ('' where it is the family's own): one put on the
    class by another library (Liger-Kernel's loss patch) is not the one the family's form describes, and the tiled
    loss, which runs it without labels, would drop what it does to the loss."""
    klass = cast(type, _family_class(model))
    forward = type(model).forward
    if (getattr(forward, "__module__", None), getattr(forward, "__qualname__", None)) == (klass.__module__,
                                                                                       f"{klass.__qualname__}.forward"):
        return ""
    return (f"{type(model).__name__}.forward is not {klass.__qualname__}'s own (another library patched it: it is "
            f"{describe_forward(forward)}); its loss could change silently")


def instance_forward_refusal(model: nn.Module) -> str:
    """Why the forward set on ``model``'s instance stops the tiled loss ('' where there is none, or it is
    the class's forward bound to the model)."""
    layers = forward_layers(model)
    if layers.mixed_precision is not None:
        return ("accelerate's mixed precision (Accelerator.prepare) wrapped its forward, and the tiled loss would run "
                "outside that wrapper. Apply the tiled loss before accelerator.prepare(model)")
    trl_head, forward = layers.trl_head, layers.forward
    if trl_head is not None and not _is_class_forward(model, trl_head.inner):
        return (f"{trl_head.describe()} is on its forward, over a forward that is not its class's "
                f"({describe_forward(trl_head.inner)}). Leave the tiled loss off for this model")
    if trl_head is not None:
        return (f"{trl_head.describe()} is on its forward: TRL's trainers compute the loss through it, in tiles, "
                "without the logits, and never call the forward the tiled loss would be on. apply_tiled_mlp(loss=True) "
                "and apply_tiled_loss leave the loss to TRL's head and say so in their report; or apply the tiled "
                "loss before building the trainer (TRL's head then wraps it)")
    if forward is None or _is_class_forward(model, forward):
        return ""
    if layers.device_hook is not None:
        return (f"accelerate's device hook on it ({layers.device_hook.hook!r}: dispatch_model, cpu_offload) wraps a "
                f"forward that is not its class's ({describe_forward(forward)}); the tiled loss would compute the loss "
                "without that forward, so what it does to the loss would be lost. Leave the tiled loss off for this model")
    return (f"its instance has a forward of its own ({describe_forward(forward)}); the tiled loss would compute the "
            "loss without it, so what it does to the loss would be lost. Take it off (del model.forward) and change "
            "the loss outside the model, or leave the tiled loss off")


def loss_left_to_trl(model: nn.Module) -> str:
    """TRL's fused LM head, where a TRL trainer put it on the model's own forward before: it computes the loss
    instead of the tiled loss ('' where nothing does)."""
    causal_lm = find_causal_lm(model)
    if causal_lm is None or _installed_on(causal_lm) is not None:
        return ""
    head = fused_head(vars(causal_lm).get("forward"))
    if head is None or not _is_class_forward(causal_lm, head.inner):
        return ""
    return (f"{type(causal_lm).__name__}: computed by {head.describe()} in tiles, without the logits; the tiled "
            "loss is not installed (TRL's calls with fused_lm_head=True never reach the model's forward)")


def loss_function_refusal(model: nn.Module) -> str:
    """Why the loss function ``model`` would call is not the one the tiled loss computes ('' when it is)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    used = model.loss_function
    if used is ForCausalLMLoss:
        return ""
    definer = next((k for k in type(model).__mro__ if "loss_function" in vars(k)), type(model))
    if "_loss_function" in vars(model):
        source = "it sets its own loss_function"
    elif definer.__module__ != "transformers.modeling_utils":
        source = f"{definer.__name__} defines its own loss_function"
    else:
        source = f"its loss_type is {getattr(model, 'loss_type', None)!r}"
    name = getattr(used, "__qualname__", None) or type(used).__qualname__
    return (f"{source} ({name}), not transformers' ForCausalLMLoss, the one the tiled loss computes; the "
            "tiled loss would replace it. Keep the default loss (no loss_function of its own, loss_type "
            "'ForCausalLM'), or leave the tiled loss off")


def _NO_MODEL() -> None:
    return None


class TiledLossForward:
    """The forward installed on a causal LM instance; picklable and deep-copyable with the model. It holds the
    model weakly: the model holds it, and a cycle would keep a deleted model's memory until the collector runs."""

    def __init__(self, model: nn.Module, form: LossForm, previous: Optional[Callable], num_shards: NumShards,
                 grad_accum_dtype: Optional[torch.dtype]):
        self._model = weakref.ref(model)
        self.form = form
        self.previous = previous  # the class's forward bound on the instance before (None: none)
        self.num_shards = num_shards
        self.grad_accum_dtype = grad_accum_dtype
        self.sequence_group: Any = None  # set by apply_sequence_parallel
        self.label_smoothing = 0.0  # F.cross_entropy's, which is the Trainer's LabelSmoother's
        self._capturing = False  # inside the model's forward run by this one
        self._captured: Optional[torch.Tensor] = None  # the decoder's hidden states of that run
        self._trl_noted = False
        self._bypass_noted = False
        self._class_forward: Any = type(model).forward  # checked at install; another one is checked at the call
        decoder: nn.Module = model.get_decoder()  # type: ignore[operator]  # a transformers PreTrainedModel
        self.decoder_hook = decoder.register_forward_hook(self.capture_decoder_output)
        self.pre_hook = model.register_forward_pre_hook(self.check_call)  # how ``_installed_on`` finds it

    @property
    def model(self) -> Any:
        """The causal LM (a transformers PreTrainedModel: get_decoder, config, ...)."""
        model = self._model()
        if model is None:
            raise RuntimeError(
                "tiled loss: the model this forward was installed on was deleted, and the forward was called without "
                "going through a model (model.forward of a shallow copy, copy.copy, which shares it). Call the model "
                "itself, or copy it with copy.deepcopy, whose copy has a tiled loss of its own")
        return model

    def __getstate__(self) -> dict:
        # Saved with the model it is installed on; the class forward is checked again at the first call.
        return {**vars(self), "_model": self._model(), "_class_forward": None}

    def __setstate__(self, state: dict) -> None:
        model = state["_model"]
        self.__dict__.update(state, _model=weakref.ref(model) if model is not None else _NO_MODEL, _class_forward=None)

    def __deepcopy__(self, memo: dict) -> TiledLossForward:
        memo[id(self.sequence_group)] = self.sequence_group  # shared: a process group cannot be copied
        clone = object.__new__(type(self))
        memo[id(self)] = clone  # the model's copy refers back to this forward's copy
        copied_alone = id(self.model) not in memo  # not inside a copy of its model
        clone.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        if copied_alone:  # nothing else holds the model's copy
            clone.__dict__["_model_copy"] = clone.model
        return clone

    def _inner(self) -> Callable:
        return self.previous if self.previous is not None else dynamo_support.bound(type(self.model).forward, self.model)

    @property
    def __signature__(self) -> inspect.Signature:
        # The Trainer reads the model's forward signature (label columns, ``**kwargs`` for num_items_in_batch).
        return inspect.signature(self._inner())

    def _capture_after_every_hook(self) -> None:
        """The capture hook last among the decoder's forward hooks, so that the loss reads the decoder's output as
        the causal LM would, after every hook registered since. Moved, not registered again: its handle's id (the
        key of torch's hook dicts, ``_forward_hooks_with_kwargs`` and ``_forward_hooks_always_called`` included)
        stays, and torch's handle counter does not move."""
        hooks = self.decoder_hook.hooks_dict_ref()
        key = self.decoder_hook.id
        if hooks is not None and key in hooks and next(reversed(hooks)) != key:
            cast(Any, hooks).move_to_end(key)

    def capture_decoder_output(self, _module: nn.Module, _args: Any, out: Any) -> None:
        if self._capturing:
            self._captured = out[0] if isinstance(out, tuple) else out.last_hidden_state

    def check_call(self, module: nn.Module, _args: Any) -> None:
        """A forward set on the model after installing may not call this one (the tiled loss would silently
        never run) or may change what it returns."""
        if self._model() is None:
            # A shallow copy (copy.copy) of a model since deleted shares this forward: it serves the copy now.
            self._model = weakref.ref(module)
        if not torch.compiler.is_compiling():
            self._check_forward()
        elif dynamo_support.TRACES_TILED_CALLS:
            # With the instance and class forwards as arguments, so that Dynamo guards on them: one set after
            # compiling traces the call again, and is checked then.
            _checked_where_traced(self, vars(self.model).get("forward"), type(self.model).forward)
        else:
            _checked_eagerly(self)

    def _check_forward(self, class_forward: bool = True) -> ForwardLayers:
        """The model's forward is still this one (and, with ``class_forward``, its class's the family's own)."""
        layers = forward_layers(self.model)
        reached = layers.forward  # this object itself, or bound to the model by accelerate's unwrap_model
        if isinstance(reached, types.MethodType) and reached.__self__ is self.model:
            reached = reached.__func__
        if reached is not self:
            replacer = describe_forward(layers.forward) if layers.forward is not None else "the class forward"
            raise RuntimeError(
                f"tiled loss: {type(self.model).__name__}'s forward was replaced after the tiled loss was installed "
                f"(it is {replacer}{layers.under()}); the tiled loss cannot tell whether it still runs or "
                "what the new forward does to the loss. Put the forward back, or remove the tiled loss first "
                "(remove_tiled_loss(model)) to run it with the model's own loss")
        if class_forward and type(self.model).forward is not self._class_forward:
            why = class_forward_refusal(self.model)
            if why:
                raise RuntimeError(
                    f"tiled loss: {type(self.model).__name__}'s class forward changed after the tiled loss was "
                    f"installed: {why}. Undo the patch, or remove the tiled loss (remove_tiled_loss(model)) to run "
                    "the patched forward with the model's own loss")
            self._class_forward = type(self.model).forward
        if layers.trl_head is not None and not self._trl_noted:
            self._trl_noted = True
            logger.warning("tiled loss: %s now wraps %s's forward: its calls with fused_lm_head=True (every labelled "
                           "call of TRL's trainers) compute TRL's loss, in tiles without the logits, and only calls "
                           "without fused_lm_head reach the tiled loss", layers.trl_head.describe(),
                           type(self.model).__name__)
        return layers

    def __call__(self, *args, **kwargs):
        if not (torch.compiler.is_compiling() and dynamo_support.TRACES_TILED_CALLS):
            return self._eager_call(*args, **kwargs)
        # Traced: the checks and the binding of the arguments decided once, where traced; then the same steps.
        names = _traced_names(self, tuple(kwargs), bool(args), self.model.loss_function)
        if names is None:
            return self._eager_call(*args, **kwargs)
        own, extra = names
        return self._run(args, kwargs, {name: kwargs[name] for name in own}, {name: kwargs[name] for name in extra})

    # Dynamo skips this frame only where it runs under torch.compile: at a break inside it, Dynamo would re-read
    # the model's bound forward as ``model.forward``, which is this object (a call to itself, without end).
    @dynamo_support.disable(recursive=False)
    def _eager_call(self, *args, **kwargs):
        if args and args[0] is self.model:  # accelerate's unwrap_model binds this forward to the model
            args = args[1:]
        self._check_forward()
        self._capture_after_every_hook()
        arguments = inspect.signature(self._inner()).bind(*args, **kwargs).arguments
        return self._run(args, kwargs, arguments, dict(arguments.pop("kwargs", {})))

    def _run(self, args: tuple, kwargs: dict, arguments: Dict[str, Any], extra: Dict[str, Any]):
        """``arguments``: the forward's named ones that were given; ``extra``: those its ``**kwargs`` takes."""
        inner = self._inner()
        labels = arguments.get("labels")
        if labels is None and extra.get("shift_labels") is None:
            self._note_bypass()
            return inner(*args, **kwargs)
        # No graph (evaluation: a Trainer's metrics read the logits): the model's own forward, logits included;
        # with label smoothing its loss is the tiled loss's all the same. Not under sequence parallelism: there
        # a rank's logits are a slice and the model's loss a slice's mean.
        evaluating = not torch.is_grad_enabled() and self.sequence_group is None
        if evaluating and not self.label_smoothing:
            return inner(*args, **kwargs)
        why = loss_function_refusal(self.model)
        if why:
            raise RuntimeError(f"tiled loss: {type(self.model).__name__}'s loss function changed after the tiled loss "
                               f"was installed: {why} (remove_tiled_loss(model))")
        keep = arguments.get("logits_to_keep", 0)
        if not (isinstance(keep, int) and keep == 0):
            raise ValueError("tiled loss: labels were given with logits_to_keep; the loss is computed over every "
                             "token. Drop logits_to_keep, or remove the tiled loss (remove_tiled_loss)")
        # As transformers' ``can_return_tuple``: the argument when given (not None), else the config's.
        return_dict = extra.pop("return_dict", arguments.pop("return_dict", None))
        if return_dict is None:
            return_dict = getattr(self.model.config, "return_dict", True)
        head = self.model.get_output_embeddings()
        arguments.update(labels=None, logits_to_keep=0 if evaluating else _no_logits(head))
        # The decoder's output reaches the loss through the hook installed with the tiled loss (a hook
        # registered per call would bump torch's class-level handle counter, which Dynamo does not trace).
        self._capturing, self._captured = True, None
        try:
            out = inner(**arguments, **extra, return_dict=True)
        finally:  # a failed call must not keep its hidden states (and graph)
            hidden, self._capturing, self._captured = self._captured, False, None
        if hidden is None:
            raise RuntimeError(f"tiled loss: {type(self.model).__name__}'s forward did not call the decoder the tiled "
                               "loss was installed on, so no hidden states reached the loss (was the decoder replaced? "
                               "remove_tiled_loss(model) and apply it again)")
        why = head_device_hook_refusal(head, hidden.device)
        if why:
            raise RuntimeError(f"tiled loss: {why}")
        softcap = getattr(self.model.config, self.form.softcap_attr) if self.form.softcap_attr else None
        loss = tiled_cross_entropy(
            hidden, head, labels, shift_labels=extra.get("shift_labels"),
            ignore_index=extra.get("ignore_index", -100), num_items_in_batch=extra.get("num_items_in_batch"),
            label_smoothing=self.label_smoothing, logit_softcap=softcap, num_shards=self.num_shards,
            grad_accum_dtype=self.grad_accum_dtype, sequence_group=self.sequence_group, model=self.model)
        if self.form.router_aux_loss and getattr(out, "aux_loss", None) is not None:
            loss = loss + self.model.router_aux_loss_coef * out.aux_loss.to(loss.device)
        dropped = ("loss",) if evaluating else ("loss", "logits")
        fields: Dict[str, Any] = {k: v for k, v in out.items() if k not in dropped}
        if return_dict:
            return type(out)(loss=loss, **fields)
        # transformers' tuple holds its fields that are not None in order; the logits keep their place (None
        # where dropped), so that ``output[2]`` is what it is without the tiled loss.
        return tuple(loss if f.name == "loss" else fields.get(f.name)
                     for f in dataclasses.fields(out) if f.name in ("loss", "logits") or fields.get(f.name) is not None)

    def _note_bypass(self) -> None:
        if self._bypass_noted or not (torch.is_grad_enabled() and self.model.training) or torch.compiler.is_compiling():
            return
        self._bypass_noted = True
        warnings.warn(
            f"tiled loss: {type(self.model).__name__} was called in training without labels, so the tiled loss did not "
            "run and the model formed the whole logits. A loss computed from them outside the model is not tiled: "
            "transformers' Trainer with label_smoothing_factor (hand the smoothing to the tiled loss: "
            "tiled_mlp.integrations.use_tiled_label_smoothing(trainer)), a compute_loss_func, or a trainer's own loss",
            UserWarning, stacklevel=4)


def _no_logits(head: nn.Module) -> Any:
    """``logits_to_keep`` while the tiled loss runs: no token; the last one for a tensor-parallel head (DTensor's
    reshape rule divides by each dimension's size). Read through ``parameters()``: ZeRO-3 gathers a parameter read
    as a module attribute."""
    if dist.is_available():
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in head.parameters()):
            return 1
    return torch.empty(0, dtype=torch.long)


@dynamo_support.decided_where_traced
def _checked_where_traced(forward: TiledLossForward, instance_forward: Any, class_forward: Any) -> bool:
    forward._check_forward()
    return True


_checked_eagerly = dynamo_support.disable(TiledLossForward._check_forward)  # torch < 2.9: behind a graph break


@dynamo_support.decided_where_traced
def _traced_names(forward: TiledLossForward, names: Tuple[str, ...], positional: bool,
                  loss_function: Any) -> Optional[Tuple[Tuple[str, ...], Tuple[str, ...]]]:
    """The eager call's checks, then ``names`` split into the forward's own parameters and those its ``**kwargs``
    takes; None where the call runs eagerly. ``loss_function`` is passed so that Dynamo guards on it."""
    forward._check_forward()
    forward._capture_after_every_hook()  # where traced: Dynamo traces the decoder's hooks in their order then
    if positional or forward.sequence_group is not None:
        return None
    if not loss_as_op(forward.model.get_output_embeddings(), "auto", False):
        return None
    parameters = inspect.signature(forward._inner()).parameters
    var_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    own = tuple(n for n in names if n in parameters and parameters[n].kind not in (inspect.Parameter.VAR_KEYWORD,
                                                                                    inspect.Parameter.VAR_POSITIONAL))
    extra = tuple(n for n in names if n not in own)
    return (own, extra) if var_keyword or not extra else None


def _installed_on(causal_lm: nn.Module) -> Optional[TiledLossForward]:
    """The tiled loss installed on ``causal_lm``, found by its forward pre-hook whatever its forward is now."""
    owners = (getattr(hook, "__self__", None) for hook in causal_lm._forward_pre_hooks.values())
    return next((owner for owner in owners if isinstance(owner, TiledLossForward)), None)


def check_tiled_loss(model: nn.Module) -> Tuple[nn.Module, LossForm]:
    """Every check before installing; returns (the causal LM, its family's form)."""
    causal_lm = find_causal_lm(model)
    if causal_lm is None:
        names = ", ".join(sorted(name for _, name in KNOWN_FORMS))
        raise TypeError(f"tiled loss: no known causal LM in {type(model).__name__}: {type(model).__name__} is not one "
                        f"of the causal LMs whose loss path is known ({names})")
    installed = _installed_on(causal_lm)
    if installed is not None:
        installed._check_forward()
        return causal_lm, installed.form
    klass = cast(type, _family_class(causal_lm))
    why = (class_forward_refusal(causal_lm) or instance_forward_refusal(causal_lm) or loss_function_refusal(causal_lm)
           or head_device_hook_refusal(cast(Any, causal_lm).get_output_embeddings()))
    if why:
        raise TypeError(f"tiled loss cannot be put on {type(causal_lm).__name__}: {why}")
    return causal_lm, KNOWN_FORMS[(klass.__module__, klass.__qualname__)]


def install_tiled_loss(model: nn.Module, num_shards: NumShards = "auto",
                       grad_accum_dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Put the tiled loss on the causal LM in ``model``; returns that causal LM. Installing twice keeps the first."""
    check_num_shards(num_shards)
    causal_lm, form = check_tiled_loss(model)
    if _installed_on(causal_lm) is None:
        # Inside accelerate's hook where there is one, which still moves the inputs and outputs around it.
        slot = "forward" if device_hook_forward(causal_lm) is None else "_old_forward"
        causal_lm.__dict__[slot] = TiledLossForward(causal_lm, form, vars(causal_lm).get(slot), num_shards,
                                                    grad_accum_dtype)
    return causal_lm


def tiled_loss_forward(model: nn.Module) -> Optional[TiledLossForward]:
    """The tiled loss installed on the causal LM in ``model``, if any."""
    causal_lm = find_causal_lm(model)
    return _installed_on(causal_lm) if causal_lm is not None else None


def set_tiled_loss_label_smoothing(model: nn.Module, factor: float) -> None:
    """Smooth the labels of the tiled loss on the causal LM in ``model`` by ``factor`` (in [0, 1]), as
    ``F.cross_entropy(label_smoothing=factor)`` does, in training and in evaluation."""
    installed = tiled_loss_forward(model)
    if installed is None:
        raise ValueError(f"tiled loss: no tiled loss on {type(model).__name__} to smooth labels in; apply it first "
                         "(apply_tiled_mlp(model, loss=True) or apply_tiled_loss(model))")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise TypeError(f"tiled loss: label smoothing is a number in [0, 1], got {factor!r}")
    CrossEntropyOptions(label_smoothing=float(factor))  # its range, checked before anything changes
    installed.label_smoothing = float(factor)


def is_tiled_loss(model: nn.Module) -> bool:
    return tiled_loss_forward(model) is not None


def remove_tiled_loss(model: nn.Module) -> bool:
    """Put the model's own forward back, inside accelerate's wrappers on it; False where no tiled loss was
    installed."""
    installed = tiled_loss_forward(model)
    if installed is None:
        return False
    causal_lm = installed.model
    # A forward put over it since: removing the tiled loss would not undo that (a class forward patched since
    # runs once it is off).
    layers = installed._check_forward(class_forward=False)
    if layers.trl_head is not None:
        # TRL's closure holds the tiled loss as the forward it calls: only a new head could drop it.
        raise RuntimeError(f"tiled loss: {layers.trl_head.describe()} wraps the tiled loss on "
                           f"{type(causal_lm).__name__} (it was added after the tiled loss), and holds it as the forward "
                           "it calls; removing the tiled loss would leave that head calling it. Build the model and the "
                           "trainer again without the tiled loss")
    wrapped, hooked = layers.mixed_precision, layers.device_hook
    restored = installed._inner()
    if hooked is not None:
        hook_wrapper = wrapped.inner if wrapped is not None else vars(causal_lm)["forward"]
        rebuilt = hook_like_add_hook(causal_lm, hooked, restored)
        # A hook added over the tiled loss copied its attributes onto the wrapper (functools.update_wrapper):
        # the wrapper add_hook_to_module builds around the model's own forward; else the one there stays.
        restored = rebuilt if getattr(hook_wrapper, "__wrapped__", None) is installed else hook_wrapper
    if wrapped is not None:
        wrap_like_prepare(causal_lm, restored, wrapped.autocast)
    elif hooked is not None or installed.previous is not None:
        causal_lm.__dict__["forward"] = restored
    else:
        del causal_lm.__dict__["forward"]
    installed.pre_hook.remove()
    installed.decoder_hook.remove()
    return True
