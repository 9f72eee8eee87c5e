"""``tiled-mlp bench --compile``'s four variants, with the compiled tiled step calling the op
``tiled_mlp::gated_mlp`` directly, on the route the tiled module's own decision gives (``decide_route``, run
eagerly here). This is what a traced tiled call becomes on torch >= 2.12. On torch 2.11 (docs/gpu.md's
machine) Dynamo cannot decide the route where it traces (``tiled_mlp.core.dynamo_support``), so
the bench's own compiled tiled variant would measure the eager fallback instead. The op, its autograd and its
fake kernel trace on 2.11 as they are.

    python docs/scripts/compile_op_cuda.py [seq hidden intermediate]   # prints JSON (DEVICE=cpu to try it here)
"""
import json
import os
import statistics
import sys

import torch

from tiled_mlp.bench import compiled as bench
from tiled_mlp.bench.measure import make_inputs, max_relative_error
from tiled_mlp.core.compiled_route import GATED_OP, decide_route
from tiled_mlp.core.ops import gated_mlp


def main() -> None:
    seq, hidden, intermediate = (int(a) for a in (sys.argv[1:4] if len(sys.argv) > 3 else (8192, 1024, 2816)))
    cfg = bench.CompileBenchConfig(hidden=hidden, intermediate=intermediate, seq=seq, dtype=torch.bfloat16,
                                   device=os.environ.get("DEVICE", "cuda"), repeats=20, warmup=3)
    torch._dynamo.reset()
    mlp, modules = bench.build_variants(cfg)
    x_data, grad_out = make_inputs(cfg.seq, cfg.hidden, cfg.dtype, torch.device(cfg.device), cfg.batch, cfg.seed)
    x_data.requires_grad_(False)
    tiled = modules["compiled_tiled"]
    route = decide_route(tiled, True, tuple(x_data.shape), x_data.dtype, x_data.device)
    if route.kind != GATED_OP:  # the policy passes this size through: nothing tiled to compare
        print(json.dumps(dict(seq=seq, hidden=hidden, intermediate=intermediate, route=route.reason)))
        return
    params = dict(tiled.named_parameters())
    tensors = [params[name] for name in route.param_names]

    def op_step(x):
        return gated_mlp(x, tensors, list(route.slots), list(route.scales), route.activation, route.use_fused,
                         route.num_shards, route.accum_dtype)

    explained = torch._dynamo.explain(op_step)(x_data.detach().requires_grad_(True))
    torch._dynamo.reset()
    modules["compiled_untiled"] = torch.compile(mlp)
    modules["compiled_tiled"] = torch.compile(op_step)
    for name in bench.VARIANTS:
        for _ in range(cfg.warmup):
            bench.variant_step(modules[name], mlp, x_data, grad_out)
    reference = bench.variant_outputs(modules["eager_untiled"], mlp, x_data, grad_out)
    rows = {}
    for name in bench.VARIANTS:
        error = max_relative_error(bench.variant_outputs(modules[name], mlp, x_data, grad_out), reference)
        rows[name] = dict(peak_mb=bench.allocated_peak_bytes(modules[name], mlp, x_data, grad_out) / 2**20,
                          grad_rel_err=error)
    seconds = bench.interleaved_seconds({n: modules[n] for n in bench.VARIANTS}, mlp, x_data, grad_out, cfg.repeats,
                                        lambda r: None)
    for name, row in rows.items():
        row["ms"] = statistics.median(seconds[name]) * 1e3
    print(json.dumps(dict(seq=seq, hidden=hidden, intermediate=intermediate, torch=torch.__version__,
                          num_shards=route.num_shards, graphs=explained.graph_count, breaks=explained.graph_break_count,
                          variants=rows, **bench.verdicts(cfg, rows, route.num_shards)), indent=1))


if __name__ == "__main__":
    main()
