"""Hugging Face models: tile every MLP block in place with one call (names and ``state_dict`` unchanged), and undo
it. A config can ask for tiling itself (``enable_tiled_mlp``, honoured by ``from_config``/``from_pretrained``)."""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

from torch import nn

from tiled_mlp.core import FastPathRefused, TiledMLP, TilingState, install_tiling, prepare_tiling, untile
from tiled_mlp.core.shard_plan import NumShards
from tiled_mlp.strategies.resolver import StrategyArg

from .args import TiledMLPFlags, check_switches, read_tiled_mlp_flags
from .causal_lm_loss import check_tiled_loss, install_tiled_loss, loss_left_to_trl, remove_tiled_loss
from .matching import Patterns, TiledExperts, scan
from .norms import NORM_ACCUM_DTYPE, TiledNorm, norm_names, why_no_norms
from .report import TiledBlock, TilingReport

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
    """Tile the MLP blocks of ``model`` in place (``loss``: the causal LM's loss too; ``norms``: its RMSNorms of the
    hidden size); returns and logs what was tiled and skipped. ``include``/``exclude`` are globs on qualified names;
    ``include`` may name a custom token-wise block. Every block is checked before any is installed, so an error
    leaves the model unchanged."""
    check_switches("apply_tiled_mlp", loss=loss, norms=norms)
    # A TRL trainer built before put its fused LM head on the forward: it computes the loss without the logits.
    loss_elsewhere = loss_left_to_trl(model) if loss else ""
    if loss and not loss_elsewhere:
        check_tiled_loss(model)  # refused before any block is tiled
    report = TilingReport(loss_left_to=loss_elsewhere)
    names = norm_names(model) if norms else []  # those within a block tiled now are tiled with it
    candidates = scan(model, report, include, exclude, norms=names)
    why = why_no_norms(model) if norms and not names else ""
    if why:
        logger.warning("tiled-mlp: norms=True tiles no norm of %s: %s", type(model).__name__, why)
        report.skipped.append(("norms", why))
    staged = []
    problems = []
    for candidate in candidates:
        mixin = {"experts": TiledExperts, "norm": TiledNorm}.get(candidate.kind, TiledMLP)
        block_path, accum = path, grad_accum_dtype
        if candidate.kind == "norm":  # path='fast' is the MLPs'; its weight sums every token
            block_path, accum = "auto", grad_accum_dtype or NORM_ACCUM_DTYPE
        try:
            fixed = prepare_tiling(mixin, candidate.module, strategy, num_shards, block_path, accum,
                                   candidate.ancestors)
        except FastPathRefused as error:  # every such block is listed, then refused together
            problems.append(f"{candidate.name}: {error}")
            continue
        staged.append((candidate, mixin, fixed, block_path, accum))
    if problems:
        raise FastPathRefused("path='fast' cannot apply to these blocks (use path='auto'):\n  " + "\n  ".join(problems))

    installed: List[TiledMLP] = []
    try:
        for candidate, mixin, fixed, block_path, accum in staged:
            state = TilingState(num_shards, block_path, accum, fixed_strategy=fixed)
            state.set_ancestors(candidate.ancestors)
            tiled = install_tiling(mixin, candidate.module, state)
            installed.append(tiled)
            report.patched.append(TiledBlock(candidate.name, candidate.kind, tiled))
        if loss and not loss_elsewhere:
            report.tiled_loss = type(install_tiled_loss(model, loss_num_shards, grad_accum_dtype)).__name__
    except BaseException:
        for tiled in installed:  # an error leaves the model as it was
            untile(tiled)
        raise
    if not report.blocks and not loss:
        logger.warning("tiled-mlp found no MLP block to tile in %s", type(model).__name__)
    logger.info("%s", report)
    return report


def apply_tiled_loss(model: nn.Module, num_shards: NumShards = "auto", grad_accum_dtype=None) -> TilingReport:
    """Only the tiled loss (an empty ``include`` selects no MLP block); ``remove_tiled_loss`` undoes it."""
    return apply_tiled_mlp(model, include=[], grad_accum_dtype=grad_accum_dtype, loss=True, loss_num_shards=num_shards)


def remove_tiled_mlp(model: nn.Module) -> List[str]:
    """Untile every tiled block in place and remove the tiled loss; returns the blocks' qualified names."""
    remove_tiled_loss(model)
    tiled = [(name, module) for name, module in model.named_modules() if isinstance(module, TiledMLP)]
    for _, module in tiled:
        untile(module)
    return [name for name, _ in tiled]


def is_tiled(model: nn.Module) -> bool:
    return any(isinstance(m, TiledMLP) for m in model.modules())


def enable_tiled_mlp(config: Any, num_shards: NumShards = "auto", path: str = "auto") -> Any:
    """Mark a config so that ``from_config``/``from_pretrained`` tile its model (``save_pretrained`` keeps it)."""
    setattr(config, CONFIG_FLAG, True)
    setattr(config, CONFIG_NUM_SHARDS, num_shards)
    setattr(config, CONFIG_PATH, path)
    return config


def maybe_apply_tiled_mlp(model: nn.Module, **kwargs) -> Optional[TilingReport]:
    config = getattr(model, "config", None)
    flags = _config_flags(config)
    if not flags.use_tiled_mlp:
        return None
    kwargs.setdefault("num_shards", flags.num_shards)
    kwargs.setdefault("path", getattr(config, CONFIG_PATH, "auto"))
    return apply_tiled_mlp(model, **kwargs)


def _config_flags(config: Any, keys=(CONFIG_FLAG, CONFIG_NUM_SHARDS)) -> TiledMLPFlags:
    # A config read from JSON or YAML may say "false" or "4": parsed, never passed to bool() or used raw.
    return read_tiled_mlp_flags({key: getattr(config, key, None) for key in keys})


def _pop_request(kwargs: dict) -> Dict[str, Any]:
    given = {key: kwargs.pop(key) for key in (CONFIG_FLAG, CONFIG_NUM_SHARDS) if key in kwargs}
    read_tiled_mlp_flags(given)
    return given


def _apply_request(given: Dict[str, Any], config: Any) -> None:
    """An explicit ``use_tiled_mlp`` decides over the config; a shard count alone needs the config to ask."""
    if not given:
        return
    if CONFIG_FLAG not in given and not _config_flags(config, (CONFIG_FLAG,)).use_tiled_mlp:
        raise ValueError(f"{CONFIG_NUM_SHARDS}={given[CONFIG_NUM_SHARDS]!r} was given, but nothing asks for tiling "
                         f"(the config does not, and {CONFIG_FLAG} was not passed): pass {CONFIG_FLAG}=True too")
    request = read_tiled_mlp_flags({CONFIG_FLAG: True, **given})
    if request.use_tiled_mlp:
        # The path saved with the model (``enable_tiled_mlp(config, path="generic")``) stays.
        enable_tiled_mlp(config, request.num_shards, path=getattr(config, CONFIG_PATH, "auto"))
    else:
        setattr(config, CONFIG_FLAG, False)


def from_config(model_class, config, **kwargs) -> nn.Module:
    """``model_class.from_config(config)``, tiled when the config or ``use_tiled_mlp``/``tiled_mlp_num_shards`` ask."""
    _apply_request(_pop_request(kwargs), config)
    build = getattr(model_class, "from_config", None) or getattr(model_class, "_from_config", None)
    model = build(config, **kwargs) if build is not None else model_class(config, **kwargs)
    maybe_apply_tiled_mlp(model)
    return model


def from_pretrained(model_class, *args, **kwargs) -> nn.Module:
    request = _pop_request(kwargs)
    model = model_class.from_pretrained(*args, **kwargs)
    _apply_request(request, model.config)
    maybe_apply_tiled_mlp(model)
    return model
