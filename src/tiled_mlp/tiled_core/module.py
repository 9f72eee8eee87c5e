"""``TiledMLP``: the thin nn.Module that runs any token-wise MLP shard by shard.

It picks the strategy (backend) and the per-shard kernel (gated fast path or generic), makes a shard
plan, and runs the shared sharded autograd Function inside one hooked call of the wrapped module.
The wrapped module's ``state_dict`` keys are kept as they were (no ``mlp.`` infix), so checkpoints
saved from an untiled model load into a tiled one and back.
"""
from __future__ import annotations

import weakref
from typing import Optional, Sequence

import torch
from torch import nn

from ..strategies.base import Strategy
from ..strategies.resolver import StrategyArg, resolve_strategy, strategy_from_arg
from .activations import gated_activation
from .auto_shards import MLPSize, auto_num_shards, intermediate_size
from .gated_spec import forward_matches_formula, structural_spec
from .hooked_call import call_with_forward
from .kernels import GatedShardKernel, GenericShardKernel
from .shard_plan import NumShards, check_num_shards, make_shard_plan
from .sharded_autograd import ShardedRun, sharded_apply
from .state_dict_keys import hide_child_in_state_dict
from .validation import check_input

PATHS = ("auto", "fast", "generic")
_INNER = "mlp"


class TiledMLP(nn.Module):
    """Wraps ``mlp`` (``[..., tokens, hidden] -> [..., tokens, out]``, token-wise) and runs it in shards.

    Args:
        mlp: the module to tile.
        strategy: "auto" (resolved from the runtime at the first forward), a registered name, or a
            ``Strategy`` instance.
        num_shards: an int >= 1, or "auto".
        path: "auto" (the gated fast kernel when it provably applies, else generic), "fast", "generic".
        grad_accum_dtype: dtype of the per-parameter gradient sums (default: the parameter's dtype);
            ``torch.float32`` for low-precision parameters.
        use_liger: use Liger-Kernel's Triton activation on CUDA when it is installed.
    """

    def __init__(
        self,
        mlp: nn.Module,
        strategy: StrategyArg = "auto",
        num_shards: NumShards = "auto",
        path: str = "auto",
        grad_accum_dtype: Optional[torch.dtype] = None,
        use_liger: bool = True,
    ):
        if not isinstance(mlp, nn.Module):
            raise TypeError(f"TiledMLP wraps an nn.Module, got {type(mlp).__name__}")
        if isinstance(mlp, TiledMLP):
            raise TypeError("this module is already a TiledMLP; wrap the inner MLP once")
        check_num_shards(num_shards)
        if path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {path!r}")
        if grad_accum_dtype is not None and not (isinstance(grad_accum_dtype, torch.dtype) and grad_accum_dtype.is_floating_point):
            raise TypeError(f"grad_accum_dtype must be a floating torch.dtype or None, got {grad_accum_dtype!r}")
        fixed = strategy_from_arg(strategy)
        super().__init__()
        self.mlp = mlp
        self.num_shards = num_shards
        self.path = path
        self.grad_accum_dtype = grad_accum_dtype
        self.use_liger = use_liger
        self._fixed_strategy: Optional[Strategy] = fixed
        self._ancestor_refs: tuple = ()
        # What the last call ran with, for reports and tests.
        self.last_path: Optional[str] = None
        self.last_num_shards: Optional[int] = None
        self._probe_cache: dict = {}
        hide_child_in_state_dict(self, _INNER)
        # Reject what is already known to be unsupported (FSDP1, per-Linear FSDP2) now; "auto" is
        # resolved again at every forward, since the model is usually wrapped after it is tiled.
        self._strategy().check_supported(mlp)

    # -- configuration ------------------------------------------------------------------------------
    def set_ancestors(self, ancestors: Sequence[nn.Module]) -> None:
        """Record the modules above this one (outermost first) so that "auto" can see a backend that
        wraps an ancestor (an FSDP2 decoder layer, say). Weak references: no cycle, no extra state."""
        self._ancestor_refs = tuple(weakref.ref(m) for m in ancestors)

    @property
    def strategy(self) -> Strategy:
        return self._strategy()

    def _strategy(self) -> Strategy:
        # Not cached: a forward before `fully_shard`, `deepspeed.initialize` or an FSDP1 wrap must not
        # pin the single-device fallback (FSDP1 would then lose every gradient silently). Resolving
        # looks at a few attributes of the MLP's own modules and parameters; it is cheap.
        if self._fixed_strategy is not None:
            return self._fixed_strategy
        ancestors = [m for m in (r() for r in self._ancestor_refs) if m is not None]
        return resolve_strategy(self.mlp, ancestors)

    # -- forward ---------------------------------------------------------------------------------------
    # torch.compile of a surrounding model runs this eagerly: the shard loop, the RNG capture and the
    # fast-path probe are not traceable, and tracing into them only produced a graph break at each.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_input(x, self.mlp)
        strategy = self._strategy()
        strategy.check_supported(self.mlp)
        spec, why_not_fast = structural_spec(self.mlp, strategy.is_backend_hook) if self.path != "generic" else (None, "path='generic'")
        if self.path == "fast" and spec is None:
            raise ValueError(f"path='fast' cannot apply to {type(self.mlp).__name__}: {why_not_fast}; use path='auto'")
        if self.path == "fast" and torch.is_autocast_enabled(x.device.type):
            raise ValueError("path='fast' cannot run under torch.autocast (it computes in the weights' dtype); "
                             "use path='auto' or cast the module to the compute dtype")
        num_tokens = x.numel() // x.shape[-1]
        num_shards = self.num_shards
        if num_shards == "auto":
            size = MLPSize(x.shape[-1], intermediate_size(self.mlp), strategy.param_bytes(self.mlp), x.element_size())
            num_shards = auto_num_shards(num_tokens, size)
        if num_tokens == 0 or num_shards is None:
            if strategy.allows_untiled_call(self.mlp):
                # Nothing to split, or too short for tiling to lower the peak: the plain module.
                self.last_path, self.last_num_shards = "untiled", 1
                return self.mlp(x)
            num_shards = 1  # the backend needs every rank on the tiled path (same collectives)
        plan = make_shard_plan(num_tokens, num_shards)

        def tiled_body(original_forward, x_in: torch.Tensor) -> torch.Tensor:
            with strategy.gathered(self.mlp):
                kernel = self._kernel(spec, original_forward, strategy, x_in)
                return sharded_apply(x_in, self._run(kernel, plan, strategy))

        self.last_num_shards = plan.num_shards
        return call_with_forward(self.mlp, tiled_body, x)

    def _run(self, kernel, plan, strategy: Strategy) -> ShardedRun:
        mlp = self.mlp
        fast = isinstance(kernel, GatedShardKernel)
        if fast:
            def current():
                spec, why_not = structural_spec(mlp, strategy.is_backend_hook)
                if spec is None:
                    raise RuntimeError(
                        f"TiledMLP: {type(mlp).__name__} no longer suits the fast path it ran forward with ({why_not}); "
                        "add hooks or wrappers before the forward, or use path='generic'"
                    )
                return spec.params
        else:
            current = lambda: strategy.trainable_params(mlp)  # noqa: E731
        return ShardedRun(
            kernel=kernel,
            plan=plan,
            gathered=lambda: strategy.gathered(mlp),
            current_params=current,
            grad_accum_dtype=self.grad_accum_dtype,
            # The fast path has no dropout (checked), so it has no random numbers to replay.
            replay_rng=not fast,
        )

    def _kernel(self, spec, original_forward, strategy: Strategy, x: torch.Tensor):
        autocast_on = torch.is_autocast_enabled(x.device.type)
        if spec is not None and not autocast_on and self._probe(spec, original_forward, x):
            self.last_path = "fast"
            return GatedShardKernel(spec, gated_activation(spec.activation, x.device, self.use_liger))
        if self.path == "fast":
            why = "autocast is enabled" if autocast_on else "its forward does not compute down(act(gate(x)) * up(x))"
            raise ValueError(f"path='fast' cannot apply to {type(self.mlp).__name__}: {why}; use path='auto'")
        self.last_path = "generic"
        prefix = (1,) * (x.dim() - 2)
        return GenericShardKernel(original_forward, strategy.trainable_params(self.mlp), prefix)

    def _probe(self, spec, original_forward, x: torch.Tensor) -> bool:
        """Does the module's real forward compute the gated formula? Cached per set of projections."""
        key = (tuple(id(m) for m in spec.linears), spec.activation, x.device.type)
        if key not in self._probe_cache:
            self._probe_cache = {key: forward_matches_formula(self.mlp, original_forward, spec, x)}
        return self._probe_cache[key]

    def extra_repr(self) -> str:
        strategy = self._fixed_strategy.name if self._fixed_strategy else "auto"
        return f"num_shards={self.num_shards!r}, path={self.path!r}, strategy={strategy!r}"

    def __getattr__(self, name: str):
        # Code that reaches into the MLP (``layer.mlp.gate_proj``, ``mlp.config``) keeps working.
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == _INNER or name.startswith("_"):
                raise
            return getattr(super().__getattr__(_INNER), name)

