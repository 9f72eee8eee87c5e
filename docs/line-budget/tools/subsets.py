"""Line counts of named parts of rows, the measured basis of REPORT.md's simplified-form estimates."""
from __future__ import annotations

from collections import Counter

from measure import count

SUBSETS = {
    "compile parts inside causal_lm_loss.py": [("tiled_mlp/integrations/causal_lm_loss.py", 288, 300),
                                               ("tiled_mlp/integrations/causal_lm_loss.py", 389, 416)],
    "wrappers kept simplified: trl_seam.py + loss_left_to_trl": [("tiled_mlp/integrations/trl_seam.py", None, None),
                                                                 ("tiled_mlp/integrations/causal_lm_loss.py", 155, 167)],
    "strategy base: capabilities check + Strategy class": [("strategies/base.py", 51, 152)],
    "kernels/base.py": [("tiled_core/kernels/base.py", None, None)],
    "ModuleTree": [("tiled_core/tiled_call.py", 139, 240)],
    "MapPlan + call_config + current_plan": [("tiled_core/tiled_call.py", 247, 318)],
    "TensorReads (class)": [("tiled_core/tensor_reads.py", 68, 187)],
    "buffer_guard.py": [("tiled_core/buffer_guard.py", None, None)],
    "auto_decision + shard_count + estimated_saved_bytes + MLPSize + intermediate_size":
        [("tiled_core/auto_shards.py", 101, 126), ("tiled_core/auto_shards.py", 150, 206)],
    "integrations/norms.py": [("tiled_mlp/integrations/norms.py", None, None)],
    "fast path kept: code_forms + fast_path + gated_spec + GatedEntry":
        [("tiled_core/code_forms.py", None, None), ("tiled_core/fast_path.py", None, None),
         ("tiled_core/gated_spec.py", None, None), ("tiled_core/builtin_kernels.py", 29, 72)],
    "gated_forms.py": [("tiled_core/gated_forms.py", None, None)],
    "hf_forms.py": [("tiled_mlp/integrations/hf_forms.py", None, None)],
    "hf.py config-flag entry (enable_tiled_mlp .. from_pretrained)": [("tiled_mlp/integrations/hf.py", 109, 167)],
    "tiled_mlp/__init__.py checkout loader": [("tiled_mlp/__init__.py", 1, 25)],
}


def measure(parts) -> Counter:
    total = Counter()
    for path, a, b in parts:
        total += count(path, None if a is None else [(a, b)])
    return total


if __name__ == "__main__":
    for name, parts in SUBSETS.items():
        c = measure(parts)
        print(f"{c['lines']:5} lines {c['statements']:5} statements  {name}")
