"""One small module per dependency whose internals the stack calls (not its public, documented API).

Each seam holds every such call into its library, the range of releases the calls were checked on
(``CHECKED``), and the adaptations between those releases, decided once at apply time by inspecting
what the library is (a function's signature, whether a name exists), never per call. A release outside
the range is refused when the piece that needs it is applied, with an error naming both versions
(``tiled_mlp.strategies.checked_versions.require``), instead of failing with a TypeError inside a forward.

- ``transformers_internals``: the mask builders (``masking_utils``), the attention registry
  (``ALL_ATTENTION_FUNCTIONS``) and the library's own sdpa / flash attention functions.
- ``deepspeed_internals``: DeepSpeed's sequence-parallel groups (``parallel_state_sp``), its Ulysses
  wrapper and data-loader adapter, and the module-level ``mpu`` slots its engines read their groups from.
"""
