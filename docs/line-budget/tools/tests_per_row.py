"""Which test files name each feature row: a test file names a row where its text, or the text of a local helper
module it imports (``integration_tests.X``, ``tests.X``, one level: the rank bodies in ``*_cases.py``), holds one
of the row's keys (case-sensitive). Counts: files, and tests collected in them (``pytest --collect-only -q`` on main
at 0b970da, saved in tools/data/collected_per_file.txt; 1,893 in all). A file counts for every row it names, so
the rows overlap: this is "which tests would notice", an over-estimate of "which tests need it".
``--dedicated`` lists, per row, only the files whose name matches one of the row's file patterns."""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # the repository

KEYS = {
    "inplace": ["untile(", "state_dict", "class_swap", "TilingState", "deepcopy"],
    "sharded": ["grad_accum_dtype", "sharded_autograd", "ShardedRun", "modified by an inplace", "double backward",
                "create_graph"],
    "call": ["last_reason", "last_path", "last_strategy", "tiled_call"],
    "plan": ["call_plan", "ModuleTree", "MapPlan", "call_config", "decisions"],
    "auto": ["auto_shards", "auto_num_shards", "auto_decision", "launch_bound", "min_tokens_per_shard"],
    "generic": ['"generic"', "'generic'", "GenericShardKernel"],
    "guards": ["changed between its forward and backward", "replaced, added or removed", "were not read by its",
               "updated its buffers", "TensorReads", "BatchNorm", "read without a gradient changed"],
    "strict": ["strict_mode", "set_strict", "TILED_MLP_STRICT", "plain_values", "PlainValues", "kept after their shard",
               "which the first shard did not"],
    "fastkernel": ['"fast"', "'fast'", "GatedShardKernel"],
    "fused": ["register_fused_kernel", "use_fused_kernel", "liger"],
    "fastproof": ["code_forms", "gated_forms", "fast_path_problem", "register_gated_mlp", "structural_decision",
                  "hf_forms", "register_gated_form", "register_activation", "register_equivalent_linear", "fast_path"],
    "kernelapi": ["register_kernel", "ShardKernel", "ReduceKernel", "kernel_registry", "available_kernels"],
    "compile": ["torch.compile", "compiled_route", "dynamo", "torch.ops.tiled_mlp", "opcheck"],
    "stratapi": ["register_strategy", "resolve_strategy", "get_strategy", "available_strategies", "check_declarations",
                 "(Strategy)", "Strategy):"],
    "ddp": ["DistributedDataParallel", "DDPStrategy"],
    "fsdp2": ["fully_shard", "FSDP2Strategy"],
    "zero": ["deepspeed.initialize", "DeepSpeedZeroStrategy", "zero_optimization", "zero_stage"],
    "fsdp1": ["FullyShardedDataParallel", "FSDP1Strategy"],
    "tp": ["parallelize_module", "ColwiseParallel", "tp_plan", "tensor_parallel"],
    "autotp": ["autotp", "AutoTP"],
    "versions": ["checked_versions", "UncheckedVersionError", "CheckedRange", "TILED_MLP_UNCHECKED_VERSIONS"],
    "loss": ["tiled_cross_entropy", "TiledCrossEntropy", "apply_tiled_loss", "loss=True"],
    "hfloss": ["apply_tiled_loss", "loss=True", "install_tiled_loss", "remove_tiled_loss", "causal_lm_loss"],
    "wrappers": ["Accelerator", "accelerate_forward", "fused_lm_head", "dispatch_model", "SFTTrainer", "add_hook"],
    "smoothing": ["label_smoothing_factor", "use_tiled_label_smoothing", "set_tiled_loss_label_smoothing"],
    "norms": ["norms=True", "TiledNorm", "norm_forms", "rms_norm", "register_norm_form"],
    "offload": ["apply_checkpoint_offload", "CheckpointOffload", "checkpoint_offload", "offload=True"],
    "ulysses": ["apply_sequence_parallel", "ulysses", "SequenceParallel("],
    "sp_loss": ["sequence_group", "sums_over_sequence_ranks", "deepspeed_sp", "SequenceParallelAware"],
    "hfapply": ["apply_tiled_mlp", "TiledExperts", "structural_kind"],
    "report": ["TilingReport", "report.patched", "report.skipped", "report.blocks", "TiledBlock"],
    "flags": ["add_tiled_mlp_args", "read_tiled_mlp_flags", "enable_tiled_mlp", "apply_long_context",
              "apply_from_flags", "from_config(", "maybe_apply_tiled_mlp"],
    "axolotl": ["axolotl"],
    "llamafactory": ["llamafactory"],
    "msswift": ["ms_swift", "swift sft"],
    "framework_common": ["framework_settings", "CheckedFramework", "FrameworkVersionError"],
    "facade": ["_load_from_checkout", "test_packaging", "wheel", "tiled_mlp.__file__"],
}
DEDICATED = {
    "inplace": ["drop_in", "state_dict", "freed_on_delete", "untiled_call", "bad_input"],
    "sharded": ["grad_delivery", "accum_dtype", "shard_plan", "backward_checks", "lora_dropout", "randomized"],
    "call": ["call_path_files", "forward_identity"],
    "plan": ["call_plan_key", "module_tree", "decision_memory", "review"],
    "auto": ["auto_policy"],
    "generic": ["generic_path", "scalar_attributes"],
    "guards": ["backward_checks"],
    "strict": ["review5", "review6", "scalar_attributes", "test_collectives.py"],
    "fastproof": ["fast_path", "forward_forms", "form_registration"],
    "kernelapi": ["kernel_base", "kernel_registry", "third_party_kernel"],
    "compile": ["compile", "ops_opcheck", "dynamo"],
    "stratapi": ["test_registry", "strategy_contract", "strategy_instances", "third_party_strategy", "strategy_arguments",
                 "docs_strategy"],
    "ddp": ["test_ddp"],
    "fsdp2": ["fsdp2"],
    "zero": ["zero"],
    "fsdp1": ["fsdp1"],
    "tp": ["tensor_parallel", "hf_tp", "collectives"],
    "autotp": ["autotp"],
    "versions": ["seams", "zero3_versions"],
    "loss": ["tiled_loss", "loss_in_head_call", "loss_distributed", "loss_tensor_parallel", "bench_loss"],
    "hfloss": ["hf_loss"],
    "wrappers": ["accelerate", "framework_trl"],
    "smoothing": ["label_smoothing"],
    "norms": ["norm"],
    "offload": ["offload"],
    "ulysses": ["ulysses", "sp_", "sequence_parallel", "demo_sp"],
    "sp_loss": ["sp_backends", "ulysses_groups", "sp_destroyed_engine"],
    "hfapply": ["hf_apply", "hf_families", "hf_multimodal", "hf_training", "hf_distributed"],
    "flags": ["flags", "long_context_stack", "stack_remove"],
    "axolotl": ["axolotl"],
    "llamafactory": ["llamafactory"],
    "msswift": ["ms_swift"],
    "framework_common": ["framework_entry_points"],
    "facade": ["packaging", "test_layout.py", "light_import", "core_is_model_neutral"],
}


def collected() -> dict:
    counts = {}
    for line in (Path(__file__).parent / "data/collected_per_file.txt").read_text().splitlines():
        path, n = line.split()
        counts[path] = int(n)
    return counts


def test_texts() -> dict:
    """Each test file's text with its local helpers' (one level)."""
    out = {}
    for path in sorted([*ROOT.glob("tests/**/test_*.py"), *ROOT.glob("integration_tests/test_*.py")]):
        rel = str(path.relative_to(ROOT))
        text = path.read_text()
        for pkg, mod in re.findall(r"(?:from|import)\s+(integration_tests|tests)\.(\w+)", text):
            helper = ROOT / pkg / f"{mod}.py"
            if helper.exists() and not mod.startswith("test_"):
                text += helper.read_text()
        out[rel] = text
    return out


def per_row(dedicated: bool = False) -> dict:
    counts, texts = collected(), test_texts()
    out = {}
    for key, words in KEYS.items():
        if dedicated:
            files = [f for f in texts if any(p in Path(f).name for p in DEDICATED.get(key, []))]
        else:
            files = [f for f, text in texts.items() if any(w in text for w in words)]
        out[key] = (len(files), sum(counts.get(f, 0) for f in files), files)
    return out


if __name__ == "__main__":
    dedicated = "--dedicated" in sys.argv
    for key, (n, tests, files) in per_row(dedicated).items():
        shown = ", ".join(Path(f).name for f in files) if dedicated else ""
        print(f"{key:16} {n:4} files {tests:5} tests  {shown}")
