"""The buffer guard: a tiled call runs the module's forward once per shard and again in the backward
recompute, so a forward that updates its buffers in place (BatchNorm's running statistics,
spectral_norm's power iteration) would update them many times. Such a forward is refused, its buffers
put back."""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence, Tuple

import torch

STATEFUL_ERROR = (
    "TiledMLP: the forward of {module} updated its buffers ({buffers}) in place, which the tiled call would "
    "repeat once per shard and again in the backward recompute (BatchNorm running statistics, spectral_norm's "
    "power iteration). The buffers were put back. Run the module untiled (untile(module)), or in "
    "eval mode, where such forwards keep their buffers."
)


@contextlib.contextmanager
def buffers_kept(module_name: str, buffers: Sequence[Tuple[str, torch.Tensor]]) -> Iterator[None]:
    """Put back and refuse, also when the forward failed for another reason. Compared by value as well as by
    version counter: BatchNorm's kernels update ``running_mean``/``running_var`` without bumping the version."""
    versions = [b._version for _, b in buffers]
    saved = [b.detach().clone() for _, b in buffers]
    try:
        yield
    finally:
        moved = [i for i, (_, b) in enumerate(buffers)
                 if b._version != versions[i] or not torch.equal(b.detach(), saved[i])]
        if moved:
            with torch.no_grad():
                for i in moved:
                    buffers[i][1].copy_(saved[i])
    if moved:
        names = ", ".join(buffers[i][0] for i in moved)
        raise RuntimeError(STATEFUL_ERROR.format(module=module_name, buffers=names))
