"""What each rank runs for ``test_fsdp2_tp.py``: a tiny Hugging Face Llama on a (dp 2, tp 2) mesh as
torchtitan builds it (tensor parallelism inside, FSDP2 outside), with every piece tiled, against one process
running the whole model on the whole batch, float64.

The TP plan is torchtitan's for Llama: q/k/v and gate/up ``ColwiseParallel``, o and down ``RowwiseParallel``,
``lm_head`` ``ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)`` (the vocabulary-parallel
tiled loss takes it from there). The tiling comes after the TP plan (``apply_tiled_mlp(model, loss=True,
norms=True)``), ``fully_shard`` over the data-parallel dimension last: each decoder layer, then the root.
Each data-parallel rank trains on its half of the batch (the TP ranks of one dp rank on the same half); with
the same count of labelled tokens in every half, FSDP2's average over dp is the whole batch's mean loss.
"""
from __future__ import annotations

import copy
from typing import Dict, List

import torch
import torch.nn.functional as F

from .comparison import full_tensor, rel_error

DP, TP = 2, 2
BATCH, SEQ, VOCAB = 4, 12, 64
STEPS, LR = 2, 0.1


def _tp_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # 4 query and 2 key/value heads: 2 and 1 on each TP rank; the MLP's 64 channels 32 a rank.
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    return LlamaForCausalLM(config).double()


def _batches() -> List[Dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        out.append(dict(input_ids=ids, labels=ids.clone()))
    return out


def _parallelize(model: torch.nn.Module, mesh) -> None:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    layer_plan = {
        "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], layer_plan)
    parallelize_module(model, mesh["tp"], {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})


def _float64_causal_loss(model: torch.nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """The causal-LM loss in float64. Not the model's own: transformers' loss casts the logits to float32
    first (measured: the untiled TP model's gradients then differ from one process's by 1e-7)."""
    logits = model(input_ids=batch["input_ids"]).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1))


def run_fsdp2_tp(rank: int, world_size: int, mlp_path: str = "fast") -> Dict[str, float]:
    """Two SGD steps of the tiled model against the reference; the MLPs asked for ``mlp_path`` ("fast": what
    "auto" proves for Llama's MLP; "generic": their own forward per shard, its collectives per shard too)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tiled_mlp import apply_tiled_mlp

    batches = _batches()
    reference = _tp_llama()
    model = copy.deepcopy(reference)
    dp = world_size // TP
    mesh = init_device_mesh("cpu", (dp, TP), mesh_dim_names=("dp", "tp"))
    _parallelize(model, mesh)
    report = apply_tiled_mlp(model, num_shards=3, path="auto" if mlp_path == "fast" else mlp_path, loss=True,
                             loss_num_shards=3, norms=True)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])

    dp_rank = mesh["dp"].get_local_rank()
    half = BATCH // dp
    errors: Dict[str, float] = {"tiled_mlps": float(sum(1 for b in report.blocks if b.name.endswith(".mlp"))),
                                "tiled_loss": float(bool(report.tiled_loss))}
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step, batch in enumerate(batches):
        ref_loss = _float64_causal_loss(reference, batch)
        ref_loss.backward()
        mine = {k: v[dp_rank * half:(dp_rank + 1) * half] for k, v in batch.items()}
        loss = model(**mine).loss
        loss.backward()
        # The rank's loss is its half's mean: the mean over dp is the whole batch's.
        global_loss = full_tensor(loss)
        torch.distributed.all_reduce(global_loss, group=mesh["dp"].get_group())
        errors[f"loss_{step}"] = rel_error(ref_loss.detach(), global_loss / dp)
        ref_grads = dict(reference.named_parameters())
        errors[f"grad_{step}"] = max(rel_error(ref_grads[name].grad, full_tensor(p.grad))
                                     for name, p in model.named_parameters())
        errors[f"mlp_path_{step}"] = float(all(layer.mlp.tiling.last_path == mlp_path for layer in model.model.layers))
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    ref_params = dict(reference.named_parameters())
    errors["params"] = max(rel_error(ref_params[name].detach(), full_tensor(p.detach())) for name, p in model.named_parameters())
    return errors
