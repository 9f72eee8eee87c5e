"""What this torch's Dynamo can do that the traced routes (``compiled_route``, ``compiled_loss`` and the HF
tiled loss's forward) rest on.

Each route is decided by a function marked ``torch._dynamo.assume_constant_result`` that is given the module
(or the head, the strategy, the loss's forward) it decides for. From torch 2.12 on, Dynamo hands such a
function the objects it is given and guards on their identity. torch 2.11 and older convert every argument
to a Python constant, which a module is not, and stop the compile with an internal error
(``UnspecializedNNModuleVariable is not a constant``), read in torch's own ``invoke_and_store_as_constant``
of each release. There, the tiled calls run eagerly behind one graph break each: a compiled model trains,
exact, with a break per tiled call (an error under ``fullgraph=True``, which says so).
"""
from __future__ import annotations

import torch

# A pre-release of 2.12 (2.12.0a0) compares below 2.12: it takes the eager routes, which every release runs.
TRACES_OBJECT_ARGUMENTS: bool = torch.__version__ >= "2.12"

OLD_DYNAMO = (f"torch {torch.__version__}'s Dynamo cannot pass a module to the route's decision (torch >= 2.12 "
              "can: upgrade to trace the call as one op)")
