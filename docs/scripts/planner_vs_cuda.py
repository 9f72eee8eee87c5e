"""The planner's modelled step against the same step run on CUDA (docs/gpu.md's planner table), one JSON
line a row; the measuring is ``tiled_mlp.bench.planner_vs_device`` (``tiled-mlp gpu-report --sections planner``
runs it with the other GPU rows and writes the table).

    SEQS=16384,65536,131072 DEPTH=4 python docs/scripts/planner_vs_cuda.py
"""
import json
import os

import torch

from tiled_mlp.bench import planner_vs_device

if __name__ == "__main__":
    planner_vs_device.run([int(s) for s in os.environ.get("SEQS", "16384,65536").split(",")],
                          int(os.environ.get("DEPTH", "4")), torch.device("cuda"),
                          int(os.environ.get("UNTILED_MAX", "65536")),
                          on_row=lambda row: print(json.dumps(row), flush=True))
