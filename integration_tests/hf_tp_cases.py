"""What each rank runs for ``test_framework_hf_tp.py``: Hugging Face's own tensor parallelism
(``from_pretrained(path, tp_plan="auto")``: DTensor weights, each Linear's forward replaced by its style's) on
a tiny Llama saved locally, tiled with ``apply_tiled_mlp(model, loss=True, norms=True)``, trained a few steps
with an optimizer, against the same checkpoint trained untiled in one process (every rank computes that
reference itself: the same data on every rank, as tensor parallelism wants).

Hugging Face's loss casts the logits to float32 (``logits.float()``); every run here keeps them float64
(``Tensor.float`` patched to the identity), so that the untiled loss is float64 too, as the tiled loss is.
"""
from __future__ import annotations

from typing import Any, Dict, List
from unittest import mock

import torch

from .comparison import full_tensor, rel_error

STEPS, SHARDS, LR, MOMENTUM = 2, 3, 0.5, 0.9
BATCH, SEQUENCE = 2, 11


def save_tiny_llama(path: str) -> None:
    """The tests' tiny Llama with as many key/value heads as query heads (2): HF's plan shards k_proj and v_proj
    colwise, which needs the key/value heads to divide over the 2 ranks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from .tiny_models import _COMMON

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**dict(_COMMON, num_key_value_heads=2))).to(torch.float64).save_pretrained(path)


def _load(path: str, tensor_parallel: bool) -> torch.nn.Module:
    import warnings

    from transformers import AutoModelForCausalLM

    extra: Dict[str, Any] = {"tp_plan": "auto"} if tensor_parallel else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # "Passing `tp_plan` directly ... is deprecated"
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager", **extra)


def _train_tp_steps(model: torch.nn.Module) -> Dict[str, Any]:
    from .tiny_models import VOCAB

    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    generator = torch.Generator().manual_seed(7)  # the same data on every rank
    losses: List[float] = []
    grads: List[Dict[str, torch.Tensor]] = []
    logits_returned = []
    with mock.patch.object(torch.Tensor, "float", lambda self: self):
        for _ in range(STEPS):
            ids = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=generator)
            out = model(input_ids=ids, labels=ids)
            logits_returned.append(out.logits is not None)
            out.loss.backward()
            losses.append(out.loss.item())
            grads.append({k: full_tensor(p.grad) for k, p in model.state_dict(keep_vars=True).items()
                          if getattr(p, "grad", None) is not None})
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    params = {k: full_tensor(p) for k, p in model.state_dict().items()}
    return {"losses": losses, "grads": grads, "params": params, "logits_returned": logits_returned}


def _training_errors(want: Dict[str, Any], have: Dict[str, Any]) -> Dict[str, float]:
    """Relative error per compared tensor; a key missing on either side is inf."""
    errors = {"loss": max(abs(a - b) / abs(a) for a, b in zip(want["losses"], have["losses"], strict=True))}
    for step, (w, h) in enumerate(zip(want["grads"], have["grads"], strict=True)):
        for key in w.keys() | h.keys():
            errors[f"grad{step}.{key}"] = rel_error(w[key], h[key]) if key in w and key in h else float("inf")
    for key in want["params"].keys() | have["params"].keys():
        w, h = want["params"].get(key), have["params"].get(key)
        errors[f"param.{key}"] = rel_error(w, h) if w is not None and h is not None else float("inf")
    return errors


def _tiled_run(path: str, tiling: Dict[str, Any]) -> Dict[str, Any]:
    from tiled_mlp.integrations import apply_tiled_mlp
    from tiled_mlp.strategies.resolver import resolve_strategy

    model = _load(path, tensor_parallel=True)
    report = apply_tiled_mlp(model, loss=True, norms=True, **tiling)
    run = _train_tp_steps(model)
    run["report"] = str(report)
    run["expected"] = {block.name: block.expected_path for block in report.patched}
    run["ran"] = {block.name: (block.tiled.tiling.last_path, block.tiled.tiling.last_num_shards,
                               block.tiled.tiling.last_reason) for block in report.patched}
    run["head_strategy"] = type(resolve_strategy(model.lm_head)).__name__
    return run


def _unchecked_version_refused(path: str) -> Dict[str, Any]:
    """``apply_tiled_mlp`` on the HF-parallel model under a transformers version the seam was not checked on (the
    installed one where it is such a version, else the seam told it knows only another): the refusal's text
    ("" where it tiled), with the versions it should name; a refusal leaves the model as it was."""
    import contextlib

    import transformers

    from tiled_mlp.integrations import apply_tiled_mlp, is_tiled
    from tiled_mlp.strategies import hf_tensor_parallel

    model = _load(path, tensor_parallel=True)
    checked = ("0.0.0",) if hf_tensor_parallel.version_checked() else hf_tensor_parallel.CHECKED_VERSIONS
    seam = (mock.patch.object(hf_tensor_parallel, "CHECKED_VERSIONS", checked) if hf_tensor_parallel.version_checked()
            else contextlib.nullcontext())
    refusal = ""
    with seam:
        try:
            apply_tiled_mlp(model, num_shards=SHARDS, loss=True, norms=True)
        except RuntimeError as error:
            assert not is_tiled(model), "a refusal leaves the model as it was"
            refusal = str(error)
    return {"refusal": refusal, "installed": transformers.__version__, "checked": ", ".join(checked)}


def _unproven_style_refused(path: str) -> Dict[str, str]:
    """Layer 0's gate_proj under a subclass of HF's ColwiseParallel (which computes the same, but is not the style
    the seam proves): the report and the first forward's refusal."""
    from transformers.distributed import tensor_parallel

    from tiled_mlp.integrations import apply_tiled_mlp

    class MyColwise(tensor_parallel.ColwiseParallel):
        pass

    model = _load(path, tensor_parallel=True)
    forward = vars(model.model.layers[0].mlp.gate_proj)["forward"]
    cell = forward.__closure__[forward.__code__.co_freevars.index("self")]
    mine = MyColwise()
    vars(mine).update(vars(cell.cell_contents))
    cell.cell_contents = mine
    report = apply_tiled_mlp(model, num_shards=SHARDS)
    ids = torch.zeros(BATCH, SEQUENCE, dtype=torch.long)
    try:
        model(input_ids=ids)
    except RuntimeError as error:
        return {"report": report.patched[0].expected_path, "raised": str(error)}
    return {"report": report.patched[0].expected_path, "raised": ""}


def run_hf_tp(rank: int, world_size: int, path: str, cases: List[str]) -> Dict[str, Any]:
    compared = {"untiled", "tiled", "generic", "defaults"} & set(cases)
    reference = _train_tp_steps(_load(path, tensor_parallel=False)) if compared else {}
    result: Dict[str, Any] = {}
    if "untiled" in cases:  # Hugging Face's tensor parallelism alone, against one process
        result["untiled"] = {"errors": _training_errors(reference, _train_tp_steps(_load(path, tensor_parallel=True)))}
    shards: Dict[str, Any] = {"num_shards": SHARDS, "loss_num_shards": SHARDS}
    # "defaults": the call as a user writes it (auto shard counts: a call this short may run untiled).
    for case, tiling in (("tiled", shards), ("generic", dict(shards, path="generic")), ("defaults", {})):
        if case in cases:
            run = _tiled_run(path, tiling)
            run["errors"] = _training_errors(reference, run)
            for key in ("grads", "params"):
                run.pop(key)
            result[case] = run
    if "unproven_style" in cases:
        result["unproven_style"] = _unproven_style_refused(path)
    if "unchecked_version" in cases:
        result["unchecked_version"] = _unchecked_version_refused(path)
    return result
