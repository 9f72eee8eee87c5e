import os
from pathlib import Path

# DeepSpeed JIT-builds a shared-memory op the first time a process initialises it (~40 s with g++):
# one build cache for the whole test run, shared by every xdist worker and spawned rank.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).parent / ".torch_extensions"))
