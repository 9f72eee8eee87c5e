"""Hugging Face models: tile every MLP block of a model in place with one call, and undo it.

Tiling is in place (``TiledMLP(block)`` returns the block itself), so every name, parameter and ``state_dict``
key stays: optimizers, PEFT adapters and checkpoints see the untiled layout. The chain of modules above each
block is recorded (``set_ancestors``) so a backend wrapping the model later is detected at the first forward.
A config can ask for tiling itself (``enable_tiled_mlp``, honoured by ``from_config``/``from_pretrained``).
"""
from __future__ import annotations

import glob
import logging
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from torch import nn

from tiled_mlp.core import FastPathRefused, TiledMLP, TilingState, install_tiling, prepare_tiling, untile
from tiled_mlp.core.shard_plan import NumShards
from tiled_mlp.strategies.resolver import StrategyArg

from .args import TiledMLPFlags, read_tiled_mlp_flags
from .causal_lm_loss import check_tiled_loss, install_tiled_loss, loss_left_to_trl, remove_tiled_loss
from .matching import Patterns, Scan, TiledExperts, find_tiled, scan
from .norms import NORM_ACCUM_DTYPE, TiledNorm, norm_names, why_no_norms
from .report import TiledBlock, TilingReport, expected_path

if TYPE_CHECKING:
    from .stack import LongContextStack

logger = logging.getLogger(__name__)

CONFIG_FLAG = "use_tiled_mlp"
CONFIG_NUM_SHARDS = "tiled_mlp_num_shards"
CONFIG_PATH = "tiled_mlp_path"


def apply_tiled_mlp(
    model: nn.Module,
    num_shards: NumShards = "auto",
    strategy: StrategyArg = "auto",
    path: str = "auto",
    include: Patterns = None,
    exclude: Patterns = None,
    grad_accum_dtype=None,
    loss: bool = False,
    loss_num_shards: NumShards = "auto",
    norms: bool = False,
) -> TilingReport:
    """Tile the MLP blocks of ``model`` in place; returns (and logs) what was tiled and skipped.

    ``loss=True`` also puts the tiled loss on the causal LM's loss path (``apply_tiled_loss``), with
    ``loss_num_shards`` shards per loss call: checked before any block is tiled. Where a TRL trainer built
    before put its fused LM head on the model's forward (it computes the loss without the logits), the loss
    is left to it and the report says so (``TilingReport.loss_left_to``).

    ``norms=True`` also tiles the model's RMSNorms of the hidden size (``norms.norm_names``; docs/long-context-stack.md,
    "Tiled RMSNorms"), with ``num_shards``, weight gradients summed in float32 or wider; ``exclude`` applies to them.

    ``include``/``exclude`` are glob patterns on qualified module names (``"model.layers.*.mlp"``);
    ``include`` may also name a custom token-wise block that no structural rule recognises. Blocks that
    are already tiled are left as they are, so calling this twice is harmless. Every block is wrapped
    and checked before any is installed: an error (an unsupported backend, ``path="fast"`` on a block
    that cannot take it) leaves the model unchanged.
    """
    # A TRL trainer built before put its fused LM head on the forward: it computes the loss without the logits.
    loss_elsewhere = loss_left_to_trl(model) if loss else ""
    if loss and not loss_elsewhere:
        check_tiled_loss(model)  # refused before any block is tiled
    found = scan(model, include, exclude)
    if norms:
        _add_norms(found, model, exclude)
    staged = []
    problems = []
    seen = set()
    for candidate in found.candidates:
        # One block reached from two parents (a shared MLP) is one module: tiled once.
        if id(candidate.module) in seen:
            continue
        seen.add(id(candidate.module))
        mixin = {"experts": TiledExperts, "norm": TiledNorm}.get(candidate.kind, TiledMLP)
        block_path, accum = path, grad_accum_dtype
        if candidate.kind == "norm":  # path='fast' is the MLPs'; its weight sums every token
            # "auto": the norm kernel where the forward is a registered norm body (``hf_forms``), else generic.
            block_path, accum = "auto", grad_accum_dtype or NORM_ACCUM_DTYPE
        # With the ancestors, a backend already wrapping the model (FSDP1 is rejected) is caught now;
        # so is path='fast' on a block whose forward or structure cannot take it.
        try:
            fixed = prepare_tiling(mixin, candidate.module, strategy, num_shards, block_path, accum,
                                   candidate.ancestors)
        except FastPathRefused as error:  # every such block is listed, then refused together
            problems.append(f"{candidate.name}: {error}")
            continue
        staged.append((candidate, mixin, fixed, block_path, accum))
    if problems:
        raise FastPathRefused("path='fast' cannot apply to these blocks (use path='auto'):\n  " + "\n  ".join(problems))

    report = TilingReport(skipped=found.skipped, loss_left_to=loss_elsewhere)
    installed: List[TiledMLP] = []
    try:
        for candidate, mixin, fixed, block_path, accum in staged:
            state = TilingState(num_shards, block_path, accum, fixed_strategy=fixed)
            state.set_ancestors(candidate.ancestors)
            tiled = install_tiling(mixin, candidate.module, state)
            installed.append(tiled)
            report.patched.append(TiledBlock(candidate.name, type(candidate.module).__name__, candidate.kind, tiled,
                                             expected_path(tiled)))
        if loss and not loss_elsewhere:
            report.tiled_loss = type(install_tiled_loss(model, loss_num_shards, grad_accum_dtype)).__name__
    except BaseException:
        for tiled in installed:  # an error leaves the model as it was
            untile(tiled)
        raise
    for old in found.already_tiled:
        report.already_tiled.append(TiledBlock(old.name, type(old.module).__name__, "tiled", old.module,
                                               expected_path(old.module)))
    if not report.blocks and not loss:
        logger.warning("tiled-mlp found no MLP block to tile in %s", type(model).__name__)
    logger.info("%s", report)
    return report


def _add_norms(found: Scan, model: nn.Module, exclude: Patterns) -> None:
    """``found`` plus the model's norms (``norms.norm_names``, none inside a block found), as candidates
    of their own kind; where there is none, the report says why."""
    names = norm_names(model, inside=[candidate.name for candidate in found.candidates])
    if not names:
        why = why_no_norms(model)
        if why:
            logger.warning("tiled-mlp: norms=True tiles no norm of %s: %s", type(model).__name__, why)
            found.skipped.append(("norms", why))
        return
    extra = scan(model, [glob.escape(name) for name in names], exclude)
    for candidate in extra.candidates:
        candidate.kind = "norm"
        found.candidates.append(candidate)
    found.skipped.extend(skip for skip in extra.skipped if skip not in found.skipped)


def apply_tiled_loss(model: nn.Module, num_shards: NumShards = "auto", grad_accum_dtype=None) -> TilingReport:
    """Only the tiled loss (no MLP block tiled): the causal LM in ``model`` computes its loss without
    holding the logits. Reversible with ``remove_tiled_loss`` (or ``remove_tiled_mlp``)."""
    loss_elsewhere = loss_left_to_trl(model)
    if loss_elsewhere:
        report = TilingReport(loss_left_to=loss_elsewhere)
    else:
        report = TilingReport(tiled_loss=type(install_tiled_loss(model, num_shards, grad_accum_dtype)).__name__)
    logger.info("%s", report)
    return report


def apply_from_flags(model: nn.Module, source, **kwargs) -> Optional[LongContextStack]:
    """The long-sequence stack as the flags (parsed arguments or a dict from a training config) ask:
    ``apply_long_context`` with ``--use_tiled_mlp`` (and ``--tiled_mlp_num_shards``), ``--use_tiled_loss``,
    ``--use_tiled_norms``, ``--use_checkpoint_offload`` and ``--ulysses_sp_size``; returns its handle (``.report`` says what
    was tiled, ``.remove()`` undoes it all), or None when no flag asks for anything. ``kwargs`` go to
    ``apply_long_context`` (``apply_tiled_mlp``'s options among them)."""
    from .stack import apply_long_context

    flags = read_tiled_mlp_flags(source)
    if not flags.asks_for_anything:
        return None
    return apply_long_context(model, tiled_mlp=flags.use_tiled_mlp, tiled_loss=flags.use_tiled_loss,
                              tiled_norms=flags.use_tiled_norms,
                              checkpoint_offload=flags.use_checkpoint_offload,
                              sequence_parallel=flags.ulysses_sp_size, num_shards=flags.num_shards, **kwargs)


def remove_tiled_mlp(model: nn.Module) -> List[str]:
    """Untile every tiled block in place (the same module objects, their original classes) and remove
    the tiled loss if it was put on; returns the qualified names of the blocks."""
    remove_tiled_loss(model)
    restored = []
    for name, _parent, _attr, tiled in find_tiled(model):
        if isinstance(tiled, TiledMLP):  # a block shared by two parents is found twice, untiled once
            untile(tiled)
            restored.append(name)
    return restored


def is_tiled(model: nn.Module) -> bool:
    return any(isinstance(m, TiledMLP) for m in model.modules())


# -- the model asks for tiling through its config -----------------------------------------------------
def enable_tiled_mlp(config: Any, num_shards: NumShards = "auto", path: str = "auto") -> Any:
    """Mark a (transformers) config so that the helpers below tile the model built from it; the flag is
    saved with ``save_pretrained``, so a reloaded checkpoint asks for tiling again."""
    setattr(config, CONFIG_FLAG, True)
    setattr(config, CONFIG_NUM_SHARDS, num_shards)
    setattr(config, CONFIG_PATH, path)
    return config


def maybe_apply_tiled_mlp(model: nn.Module, **kwargs) -> Optional[TilingReport]:
    """Tile ``model`` if its config says ``use_tiled_mlp``; ``kwargs`` go to ``apply_tiled_mlp``."""
    config = getattr(model, "config", None)
    flags = _config_flags(config)
    if not flags.use_tiled_mlp:
        return None
    kwargs.setdefault("num_shards", flags.num_shards)
    kwargs.setdefault("path", getattr(config, CONFIG_PATH, "auto"))
    return apply_tiled_mlp(model, **kwargs)


def _config_flags(config: Any, keys=(CONFIG_FLAG, CONFIG_NUM_SHARDS)) -> TiledMLPFlags:
    """The tiling flags a model's config holds (of ``keys``; the others at their defaults). A config read from
    JSON or YAML may say "false" or "4": parsed, never passed to bool() or used raw."""
    return read_tiled_mlp_flags({key: getattr(config, key) for key in keys if getattr(config, key, None) is not None})


def _pop_request(kwargs: dict) -> Dict[str, Any]:
    """The tiling request among ``from_*`` keyword arguments (removed from them; empty if there is none), its
    values checked before any work."""
    given = {key: kwargs.pop(key) for key in (CONFIG_FLAG, CONFIG_NUM_SHARDS) if key in kwargs}
    read_tiled_mlp_flags(given)
    return given


def _apply_request(given: Dict[str, Any], config: Any) -> None:
    """An explicit ``use_tiled_mlp`` decides, either way, over what the config says. A shard count given alone
    replaces the config's where the config asks for tiling, and is refused where nothing does (it would be
    dropped without a word)."""
    if not given:
        return
    if CONFIG_FLAG not in given:
        if not _config_flags(config, (CONFIG_FLAG,)).use_tiled_mlp:
            raise ValueError(f"{CONFIG_NUM_SHARDS}={given[CONFIG_NUM_SHARDS]!r} was given, but nothing asks for tiling "
                             f"(the config does not, and {CONFIG_FLAG} was not passed): pass {CONFIG_FLAG}=True too")
        given = {CONFIG_FLAG: True, **given}
    request = read_tiled_mlp_flags(given)
    if request.use_tiled_mlp:
        # The path saved with the model (``enable_tiled_mlp(config, path="generic")``) stays.
        enable_tiled_mlp(config, request.num_shards, path=getattr(config, CONFIG_PATH, "auto"))
    else:
        setattr(config, CONFIG_FLAG, False)


def from_config(model_class, config, **kwargs) -> nn.Module:
    """``model_class.from_config(config)`` (an Auto class or a model class), tiled when the config or
    ``use_tiled_mlp=True``/``tiled_mlp_num_shards=...`` in ``kwargs`` ask for it."""
    _apply_request(_pop_request(kwargs), config)
    build = getattr(model_class, "from_config", None) or getattr(model_class, "_from_config", None)
    model = build(config, **kwargs) if build is not None else model_class(config, **kwargs)
    maybe_apply_tiled_mlp(model)
    return model


def from_pretrained(model_class, *args, **kwargs) -> nn.Module:
    """``model_class.from_pretrained(...)``, tiled when the saved config or ``use_tiled_mlp=True`` ask."""
    request = _pop_request(kwargs)
    model = model_class.from_pretrained(*args, **kwargs)
    _apply_request(request, model.config)
    maybe_apply_tiled_mlp(model)
    return model
