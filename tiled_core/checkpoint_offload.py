"""Checkpoint offload: the input of each checkpointed layer but the last waits for its backward in host memory,
moved by identity from an outer ``saved_tensors_hooks`` around the layer's call (docs/long-context-stack.md)."""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn


@dataclass
class HostBytes:
    """Host memory the offloaded layer inputs hold: now, and the most at once."""

    current: int = 0
    peak: int = 0

    def add(self, num_bytes: int) -> None:
        self.current += num_bytes
        self.peak = max(self.peak, self.current)


class _LayerCall:
    """One call of an offloaded layer: its input, and once the checkpoint saved that input, the copy in host memory
    that autograd holds (the packed value) until the backward brings it back."""

    def __init__(self, offload: CheckpointOffload, tensor: torch.Tensor) -> None:
        self.offload = offload
        self.tensor: Optional[torch.Tensor] = tensor
        self.host: Optional[torch.Tensor] = None
        self.event: Any = None
        self.context: Any = torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack)

    def pack(self, tensor: torch.Tensor) -> Any:
        if not _same_memory(tensor, self.tensor):
            return tensor  # any other saved tensor (an uncheckpointed layer's activations) stays as it is
        if self.host is not None:
            return self  # saved again in the same call: one copy
        self.device = tensor.device
        host = "meta" if tensor.is_meta else "cpu"  # the planner's modelled step allocates nothing anywhere
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, device=host, pin_memory=tensor.is_cuda)
        stream = self.offload._side_stream(tensor)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(stream):
                self.host.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)  # not reused by the allocator before the copy is done
            self.event = stream.record_event()
        else:
            self.host.copy_(tensor)
        num_bytes = self.host.numel() * self.host.element_size()
        self.offload.host_bytes.add(num_bytes)
        weakref.finalize(self, self.offload.host_bytes.add, -num_bytes)
        if self.offload.on_host_copy is not None:
            self.offload.on_host_copy(self.host)
        return self

    def back(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        assert self.host is not None
        # A copy even where host and device are one memory: a CPU step holds what a GPU step holds (the planner).
        return self.host.to(self.device, non_blocking=self.host.is_pinned(), copy=True)


class CheckpointOffload:
    """Offloads the inputs of ``layers`` (checkpointed decoder layers, in call order) to host memory;
    the last one's stays on the device. ``remove()`` undoes it. The layers are held weakly: their hooks hold this
    object, and a cycle would keep a deleted model, and its memory, until the garbage collector runs."""

    def __init__(self, layers: Sequence[nn.Module], on_host_copy: Optional[Callable[[torch.Tensor], None]] = None,
                 on_remove: Optional[Callable[[], None]] = None) -> None:
        self.host_bytes = HostBytes()
        # Called with each host copy as it is made: a memory tracker counts it apart from the device's.
        self.on_host_copy = on_host_copy
        # Called once by ``remove()``: undoes what the caller set up around the layers.
        self.on_remove = on_remove
        self._layers = [weakref.ref(layer) for layer in layers]
        self._handles: List[Any] = []
        self._calls: Dict[int, List[Optional[_LayerCall]]] = {}
        self._stream: Optional[Any] = None
        for layer in list(layers)[:-1]:
            self._handles.append(layer.register_forward_pre_hook(self._enter, with_kwargs=True))
            self._handles.append(layer.register_forward_hook(self._exit, always_call=True))

    @property
    def layers(self) -> List[nn.Module]:
        return [layer for layer in (ref() for ref in self._layers) if layer is not None]

    def __getstate__(self) -> dict:
        return {**vars(self), "_layers": self.layers}  # saved (pickled, deep-copied) with its layers

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _layers=[weakref.ref(layer) for layer in state["_layers"]])

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.on_remove is not None:
            self.on_remove()
            self.on_remove = None

    def _enter(self, layer: nn.Module, args: tuple, kwargs: dict) -> None:
        calls = self._calls.setdefault(id(layer), [])
        if not args or not isinstance(args[0], torch.Tensor) or not torch.is_grad_enabled():
            calls.append(None)  # nothing to offload (kwargs-only, no graph)
            return
        call = _LayerCall(self, args[0])
        call.context.__enter__()
        calls.append(call)

    def _exit(self, layer: nn.Module, args: tuple, *rest) -> None:
        call = self._calls[id(layer)].pop()
        if call is not None:
            call.context.__exit__(None, None, None)
            # Autograd keeps the pack hook (and so ``call``) with each tensor it saved: holding the input from here
            # would free nothing, and the context -> hook -> call cycle would keep the host copy until gc ran.
            call.tensor = call.context = None

    def _side_stream(self, tensor: torch.Tensor) -> Optional[Any]:
        if not tensor.is_cuda:
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(tensor.device)
        return self._stream


def _same_memory(tensor: torch.Tensor, layer_input: Optional[torch.Tensor]) -> bool:
    """``tensor`` is the layer's input, or an alias of it over the same memory: a pre-hook registered later may
    replace the input so (ZeRO-3's ``input.detach()``), and the checkpoint saves that alias."""
    if tensor is layer_input:
        return True
    if type(tensor) is not torch.Tensor or type(layer_input) is not torch.Tensor or tensor.is_meta:
        return False
    return (tensor.data_ptr() == layer_input.data_ptr() and tensor.shape == layer_input.shape
            and tensor.stride() == layer_input.stride() and tensor.dtype == layer_input.dtype
            and tensor.device == layer_input.device)


def _unpack(packed: Any) -> torch.Tensor:
    return packed.back() if isinstance(packed, _LayerCall) else packed
