"""The built-in kernels as registry entries: the gated fast kernel, the norm kernel and the generic kernel for
token-wise modules; the vocabulary-parallel, linear and module heads for the loss. Each decides from what the
module *is* (its forward's code, its structure, its class), never from a numeric probe.
"""
from __future__ import annotations

import functools
from typing import Any, Optional, Tuple

import torch
from torch import nn

from .fast_path import structural_decision
from .gated_spec import foreign_child_hooks
from .kernel_registry import MAP, REDUCE, TOKEN_INPUTS_DECLINED, Kernel, KernelCall, register_kernel
from .kernels.gated import DOWN_WEIGHT_ARG, GatedShardKernel, gated_activation
from .kernels.generic import GenericShardKernel, generic_layout
from .kernels.lm_head import LinearHeadKernel, ModuleHeadKernel, is_plain_linear
from .kernels.rms_norm import RMSNormShardKernel
from .module_forward import forward_function
from .norm_forms import norm_spec
from .sharded_autograd import autocast_enabled
from .tiling_state import tiling_of

# A head split over ranks by vocabulary holds only its rows here: a whole-vocabulary kernel would compute wrong.
VOCAB_SPLIT_DECLINED = "the head's vocabulary is split over ranks (only a vocabulary-parallel kernel computes its loss)"


class GatedEntry(Kernel):
    """``down(act(gate(x)) * up(x))`` computed directly where the forward is proven to compute exactly that."""

    name = "fast"
    shape = MAP
    keeps_grad_buffers = False  # weight gradients go straight into one buffer per weight
    answers_per_plan = True  # the plan's key, and its structural decision made again in strict mode

    def why_not(self, call: KernelCall) -> str:
        if call.token_inputs:
            return TOKEN_INPUTS_DECLINED
        module, plan, x, hook = call.module, call.cache, call.x, call.strategy.is_backend_hook
        if plan.fast is None:
            plan.fast = structural_decision(module, forward_function(module), hook)
            native = plan.fast[0]
            if native is not None:
                # What the plan's key does not see (a class changed, a module global rebound, a torch function
                # patched) guards the plan in strict mode: the decision is made again at each call.
                plan.add_guards(lambda module: structural_decision(module, forward_function(module), hook)[0] is not None)
                plan.tree.watch(module, native.reads)
                weight = native.params[native.layout.slots[DOWN_WEIGHT_ARG]]
                if autocast_enabled(x.device.type):
                    plan.fast = None, "autocast is enabled (the fast kernel computes in the weights' dtype)"
                elif x.dtype != weight.dtype:
                    # The module may cast its input (or fail); the generic path does exactly what it does.
                    plan.fast = None, f"the input is {x.dtype} but the weights are {weight.dtype}"
                elif x.device != weight.device:
                    plan.fast = None, f"the input is on {x.device} but the weights are on {weight.device}"
        native, why_not = plan.fast
        if native is None:
            return why_not
        # Distributed parameters: the kernel runs on the strategy's local view, where one stands in exactly.
        view = call.strategy.local_view(module, native.params)
        return "" if view is None else view.why_not

    def build(self, call: KernelCall) -> GatedShardKernel:
        plan = call.cache
        if plan.fast_kernel is None:  # stateless: one per plan, with the activation kernel for the device
            native, use_fused = plan.fast[0], tiling_of(call.module).use_fused_kernel
            activation = gated_activation(native.activation.name, call.x.device, use_fused)
            plan.fast_kernel = GatedShardKernel(native.layout, activation, native.params, native.module_name,
                                                native.reads)
        return plan.fast_kernel


class NormEntry(Kernel):
    """A proven RMSNorm (``norm_forms``) computed by the body's own operations per shard (``kernels/rms_norm.py``)."""

    name = "norm"
    shape = MAP
    keeps_grad_buffers = True  # the weight's gradient buffer beside the module's, as the generic kernel's

    @staticmethod
    def spec_for(module: nn.Module, strategy: Any,
                 weight_is_local: bool = True) -> Tuple[Optional[RMSNormShardKernel], str]:
        """The kernel for ``module`` whatever the input, or why not: asked at every call, and by
        ``apply_tiled_mlp``'s report (``weight_is_local`` False where the backend holds shards then)."""
        kernel, why_not = norm_spec(module, forward_function(module))  # cheap: reads the forward's helpers again
        if kernel is not None and weight_is_local and strategy.local_view(module, kernel.params) is not None:
            return None, "the weight is distributed (the generic kernel runs the module's own forward on it)"
        return kernel, why_not

    def why_not(self, call: KernelCall) -> str:
        if call.token_inputs:
            return TOKEN_INPUTS_DECLINED
        x = call.x
        kernel, why_not = self.spec_for(call.module, call.strategy)
        if kernel is None:
            return why_not
        weight = kernel.params[0]
        if autocast_enabled(x.device.type):
            return "autocast is enabled (the norm kernel computes in the body's own dtypes)"
        if x.device != weight.device:
            return f"the input is on {x.device} but the weight is on {weight.device}"
        if tuple(weight.shape) != (x.shape[-1],):
            return f"the weight's shape {tuple(weight.shape)} is not the input's width ({x.shape[-1]},)"
        call.cache.kernel_cache["norm"] = kernel
        return ""

    def build(self, call: KernelCall) -> RMSNormShardKernel:
        return call.cache.kernel_cache["norm"]


class GenericEntry(Kernel):
    """Any token-wise module: its own forward per shard, recomputed with autograd in backward."""

    name = "generic"
    shape = MAP

    def why_not(self, call: KernelCall) -> str:
        # Per plan: whether one shard computes what the call does (a backend's collective may span the call's tokens).
        cached = call.cache.kernel_cache
        key = f"generic.per_shard.{call.x.dim()}"
        if key not in cached:
            cached[key] = call.strategy.per_shard_problem(call.module, call.x.dim() - 1)
        return cached[key]

    def build(self, call: KernelCall) -> GenericShardKernel:
        module, plan = call.module, call.cache
        hooks = functools.partial(foreign_child_hooks, module, call.strategy.is_backend_hook)
        layout = plan.kernel_cache.get("generic.layout")
        if layout is None:
            layout = plan.kernel_cache["generic.layout"] = generic_layout(module, plan.trainable, hooks(),
                                                                          tiling_of(module).instance_forward)
        assert call.shard_forward is not None, "a map call gives what one shard runs"
        prefix = (1,) * (call.x.dim() - 2)
        kernel = GenericShardKernel(module, call.shard_forward, plan.trainable, prefix,
                                    layout, hooks, grad_mode=torch.is_grad_enabled(),
                                    token_inputs=call.token_inputs)
        # A view under which the module's own forward computes on local tensors (sequence parallelism on a norm)
        # is entered; a module whose submodules' tensor-parallel hooks hand it local tensors runs with none.
        view = call.strategy.local_view(module, plan.trainable)
        kernel.runs_on_local_view = view is not None and getattr(view, "runs_module_forward", False)
        return kernel


class LinearHeadEntry(Kernel):
    """A plain ``nn.Linear`` head: logits by one matmul per shard, gradients formed from them (on this rank's rows
    of a head split over ranks: ``VocabParallelEntry``)."""

    name = "linear_head"
    shape = REDUCE

    def why_not(self, call: KernelCall) -> str:
        if call.vocab_slice is not None:
            return VOCAB_SPLIT_DECLINED
        return "" if is_plain_linear(call.module) else "the head is not a plain nn.Linear"

    def build(self, call: KernelCall) -> LinearHeadKernel:
        rows: Any = call.vocab_slice or call.module  # a VocabSlice, or the plain nn.Linear itself
        return LinearHeadKernel(rows.weight, rows.bias, call.options, type(call.module).__name__, call.vocab_slice)


class VocabParallelEntry(LinearHeadEntry):
    """A plain ``nn.Linear`` head split over ranks by vocabulary: the cross-entropy reduced over the group."""

    name = "vocab_parallel"

    def why_not(self, call: KernelCall) -> str:
        if call.vocab_slice is None:
            return "the head's vocabulary is whole on this rank"
        return "" if is_plain_linear(call.module, call.strategy.is_backend_hook) else "the head is not a plain nn.Linear"


class ModuleHeadEntry(Kernel):
    """Any head module (PEFT's LoRA ``lm_head``): its own forward per shard, its gradients by autograd."""

    name = "module_head"
    shape = REDUCE

    def why_not(self, call: KernelCall) -> str:
        return VOCAB_SPLIT_DECLINED if call.vocab_slice is not None else ""

    def build(self, call: KernelCall) -> ModuleHeadKernel:
        return ModuleHeadKernel(call.module, call.trainable, call.options)


for _kernel, _priority in ((GatedEntry(), 10), (NormEntry(), 5), (GenericEntry(), 0), (VocabParallelEntry(), 20), (LinearHeadEntry(), 10),
                          (ModuleHeadEntry(), 0)):
    register_kernel(_kernel, priority=_priority)
