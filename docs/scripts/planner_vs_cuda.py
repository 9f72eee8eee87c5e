"""The planner's modelled step (meta tensors) against the same step run on CUDA: the live-storage
tracker's peak (exact bytes) and the caching allocator's max_memory_allocated, for Llama-3.1-8B's
shape cut to a few layers, untiled and with the whole stack (docs/gpu.md's last table); the modelled peak
also with the attention kernel's own workspace, as a GPU plan models it.

    SEQS=16384,65536,131072 DEPTH=4 python docs/scripts/planner_vs_cuda.py   # one JSON line a row
"""
import gc
import json
import os
import time

import torch

from tiled_mlp.planner import attention
from tiled_mlp.planner.attention_workspace import gpu_kernel
from tiled_mlp.planner.presets import load_config
from tiled_mlp.planner.step import Setting, build_model, step_timeline

depth = int(os.environ.get("DEPTH", "4"))
seqs = [int(s) for s in os.environ.get("SEQS", "16384,65536").split(",")]
config = load_config("llama-3.1-8b")
settings = {
    "untiled+ckpt": Setting(tiled=False, checkpointing=True),
    "tiled+tiled-loss+norms+ckpt": Setting(tiled=True, checkpointing=True, tiled_loss=True, tiled_norms=True),
}
untiled_max = int(os.environ.get("UNTILED_MAX", "65536"))
for seq in seqs:
    for name, setting in settings.items():
        if name.startswith("untiled") and seq > untiled_max:
            continue
        gc.collect()
        t0 = time.time()
        meta = build_model(config, depth, torch.bfloat16, "meta", setting)
        modelled = step_timeline(meta, seq, 1).peak()[0]
        with attention.gpu_workspace(gpu_kernel("sdpa")):  # sdpa's flash backend's own buffers (attention_workspace.py)
            with_workspace = step_timeline(meta, seq, 1).peak()[0]
        del meta
        t1 = time.time()
        gc.collect()
        torch.cuda.empty_cache()
        model = build_model(config, depth, torch.bfloat16, "cuda", setting)
        step_timeline(model, seq, 1)  # warm-up: cuBLAS workspaces, kernels
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        tracked = step_timeline(model, seq, 1).peak()[0]
        torch.cuda.synchronize()
        allocator = torch.cuda.max_memory_allocated()
        t2 = time.time()
        row = dict(seq=seq, setting=name, depth=depth, modelled_gib=modelled / 2**30, tracked_on_cuda_gib=tracked / 2**30,
                   allocator_peak_gib=allocator / 2**30, allocated_before_step_gib=before / 2**30,
                   tracked_over_modelled=tracked / modelled, allocator_over_modelled=allocator / modelled,
                   modelled_with_workspace_gib=with_workspace / 2**30,
                   allocator_over_modelled_with_workspace=allocator / with_workspace,
                   model_s=t1 - t0, cuda_s=t2 - t1)
        print(json.dumps(row), flush=True)
        del model
        gc.collect()
        torch.cuda.empty_cache()
