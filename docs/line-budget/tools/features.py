"""Which feature or guarantee each line of the counted library serves (issue 45's budget).

ROWS: key -> (title, [path or (path, first, last) ...]). Ranges are inclusive line numbers of main at 0b970da;
a path alone is the whole file. ``check.py``/``table.py`` refuse a map that leaves a line out or counts one twice.
A range is cut at function/class/constant boundaries; a function that serves two features goes to the one it
mostly serves (noted in REPORT.md where it matters).
"""
SA = "tiled_core/sharded_autograd.py"
TC = "tiled_core/tiled_call.py"
GEN = "tiled_core/kernels/generic.py"
TR = "tiled_core/tensor_reads.py"
COL = "tiled_core/collectives.py"
BK = "tiled_core/builtin_kernels.py"
TL = "tiled_core/tiled_loss.py"
MF = "tiled_core/module_forward.py"
CLL = "tiled_mlp/integrations/causal_lm_loss.py"
SB = "strategies/base.py"
RES = "strategies/resolver.py"
HF = "tiled_mlp/integrations/hf.py"
INT = "tiled_mlp/integrations/__init__.py"
KG = "tiled_core/kernels/gated.py"

ROWS = {
    # -- the core mechanism ---------------------------------------------------------------------------------
    "inplace": ("Tiling in place: TiledMLP/tile/untile, class swap, TilingState, the module's forward, input checks", [
        "tiled_core/class_swap.py", ("tiled_core/module.py", 1, 95), ("tiled_core/module.py", 100, 108),
        "tiled_core/tiling_state.py", (MF, 1, 23), (MF, 29, 36), (MF, 44, 54), (MF, 60, 142),
        "tiled_core/validation.py"]),
    "sharded": ("Sharded autograd: map Function, gradient buffers delivered once, RNG/autocast replay, saved input, "
                "shard plan, in-place/double-backward refusals", [
        (SA, 1, 24), (SA, 64, 272), (SA, 288, 328), (SA, 368, 531), "tiled_core/shard_plan.py", "tiled_core/checks.py"]),
    "call": ("The one call: argument routing, strategy per call, decision, run assembly", [
        (TC, 1, 106), (TC, 319, 327), (TC, 348, 385), (TC, 396, 456), (TC, 471, 519), (TC, 531, 532)]),
    "plan": ("Call plan and per-call identity checks: ModuleTree, MapPlan, call_config, registration counter, "
             "decision memo", [(TC, 107, 240), (TC, 247, 318), (TC, 328, 347)]),
    "auto": ("Auto shard policy (num_shards='auto', pass-through of short calls)", [
        "tiled_core/auto_shards.py", (TC, 386, 395)]),
    "generic": ("Generic kernel: any token-wise module, its own forward per shard, autograd recompute", [
        (GEN, 1, 20), (GEN, 26, 31), (GEN, 49, 146), (GEN, 161, 163), (GEN, 173, 209), (BK, 111, 143)]),
    "guards": ("Generic path's default guards: tensors read from outside found (reads discovery), changed reads, "
               "hooks/children changed between forward and backward, buffer guard", [
        (GEN, 21, 25), (GEN, 32, 48), (GEN, 157, 160), (GEN, 164, 172), (GEN, 210, 245),
        (TR, 1, 43), (TR, 67, 140), (TR, 151, 154), (TR, 188, 204), "tiled_core/buffer_guard.py"]),
    "strict": ("Strict mode: plain values, kept-tensor polling (gc + up to 2 s), late reads, deep tree compare", [
        "tiled_core/strict.py", "tiled_core/plain_values.py", (SA, 25, 45), (SA, 329, 367), (GEN, 147, 156),
        (TR, 44, 66), (TR, 141, 150), (TR, 155, 187), (COL, 1, 30), (COL, 54, 66), (TC, 241, 246)]),
    # -- the gated fast path ------------------------------------------------------------------------------------
    "fastkernel": ("Gated fast kernel (down_proj never recomputed), its layouts", [(KG, 1, 57), (KG, 101, 218)]),
    "fused": ("Fused activation registry and Liger's Triton activation", [
        (KG, 58, 100), "tiled_mlp/integrations/liger_activation.py"]),
    "fastproof": ("Fast-path proof: code forms, gated forms, structural matching, hook spec, HF forward bodies", [
        "tiled_core/code_forms.py", "tiled_core/gated_forms.py", "tiled_core/fast_path.py", "tiled_core/gated_spec.py",
        "tiled_mlp/integrations/hf_forms.py", (BK, 29, 72)]),
    # -- extension API -------------------------------------------------------------------------------------------
    "kernelapi": ("Kernel registry and extension API: Kernel/ShardKernel/ReduceKernel, register_kernel, declared-"
                  "tensor and shard-shape refusals", [
        "tiled_core/kernel_registry.py", "tiled_core/kernels/base.py", "tiled_core/kernels/__init__.py",
        (BK, 1, 24), (BK, 27, 28), (BK, 185, 187), (SA, 46, 54)]),
    # -- compile ------------------------------------------------------------------------------------------------
    "compile": ("torch.compile: custom ops, traced route, Dynamo helpers", [
        "tiled_core/compiled_route.py", "tiled_core/dynamo_support.py", "tiled_core/ops/__init__.py",
        "tiled_core/ops/gradient_slots.py", "tiled_core/ops/linear_cross_entropy.py", "tiled_core/ops/map_ops.py",
        ("tiled_core/module.py", 96, 99), (MF, 24, 28), (MF, 37, 43), (MF, 55, 59),
        (TL, 98, 103), (TL, 136, 137), (TL, 184, 218), (CLL, 288, 300), (CLL, 389, 416)]),
    # -- strategies ----------------------------------------------------------------------------------------------
    "stratapi": ("Strategy framework: base, declared capabilities, registry, resolver, single device", [
        (SB, 1, 41), (SB, 51, 152), (SB, 166, 172), "strategies/registry.py", (RES, 1, 88), (RES, 115, 132),
        "strategies/__init__.py", "strategies/single_device.py"]),
    "ddp": ("DDP strategy", ["strategies/ddp.py"]),
    "fsdp2": ("FSDP2 strategy", ["strategies/fsdp2.py"]),
    "zero": ("DeepSpeed ZeRO 1/2/3 strategy (+ ZeRO-3's linear registered as equivalent)", [
        "strategies/deepspeed_zero.py", (INT, 30, 34)]),
    "fsdp1": ("FSDP1 refusal", ["strategies/fsdp1.py"]),
    "tp": ("DTensor tensor parallelism: local views, TP/SP-norm layouts, HF tp_plan, vocab-parallel head", [
        "strategies/tensor_parallel.py", "strategies/tensor_parallel_head.py", "strategies/hf_tensor_parallel.py",
        "tiled_core/local_view.py", (COL, 31, 53), (TC, 457, 470), (BK, 161, 171), (SB, 183, 193)]),
    "autotp": ("DeepSpeed AutoTP", ["strategies/deepspeed_autotp.py"]),
    "versions": ("Version seam for dependencies (checked ranges, refusal of others)", [
        "strategies/checked_versions.py", "tiled_mlp/integrations/seams/__init__.py"]),
    # -- the loss ------------------------------------------------------------------------------------------------
    "loss": ("Tiled loss core: tiled_cross_entropy, reduce Function, LM-head and cross-entropy kernels (smoothing, "
             "softcap, z-loss), head call", [
        (TL, 1, 97), (TL, 104, 135), (TL, 138, 183), (TL, 219, 345), "tiled_core/kernels/lm_head.py",
        "tiled_core/kernels/cross_entropy.py", "tiled_core/loss_shards.py", (SA, 55, 63), (SA, 273, 287),
        (SA, 532, 569), (TC, 520, 530), (BK, 25, 26), (BK, 144, 160), (BK, 172, 184), (SB, 173, 182)]),
    "hfloss": ("HF causal-LM loss routing: TiledLossForward on the model, loss-function/logits_to_keep refusals", [
        (CLL, 1, 75), (CLL, 168, 287), (CLL, 301, 365), (CLL, 378, 388), (CLL, 417, 467), (CLL, 481, 515),
        (HF, 89, 94)]),
    "wrappers": ("Forward wrappers recognised around the loss: accelerate's mixed precision/device hooks, TRL's fused "
                 "head (and the refusals naming them)", [
        "tiled_mlp/integrations/accelerate_forward.py", "tiled_mlp/integrations/trl_seam.py", (CLL, 76, 167)]),
    "smoothing": ("Trainer label smoothing handed to the tiled loss", [
        "tiled_mlp/integrations/trainer_label_smoothing.py", (CLL, 366, 377), (CLL, 468, 480)]),
    # -- other features ------------------------------------------------------------------------------------------
    "norms": ("Tiled RMSNorms: norm forms, norm kernel, which norms", [
        "tiled_core/norm_forms.py", "tiled_core/kernels/rms_norm.py", "tiled_mlp/integrations/norms.py", (BK, 73, 110)]),
    "offload": ("Checkpoint offload", ["tiled_core/checkpoint_offload.py", "tiled_mlp/integrations/offload.py"]),
    "ulysses": ("Ulysses SP on a HF model: apply_sequence_parallel, attention, masks, RoPE, DeepSpeed/transformers "
                "seams", [
        "tiled_mlp/integrations/ulysses.py", "tiled_mlp/integrations/ulysses_masks.py",
        "tiled_mlp/integrations/ulysses_rope.py", "tiled_mlp/integrations/seams/deepspeed_internals.py",
        "tiled_mlp/integrations/seams/transformers_internals.py"]),
    "sp_loss": ("The loss over a sequence split across ranks: sum over the SP group, whether each backend sums or "
                "averages over SP ranks (DeepSpeed engine read, SP-aware strategies)", [
        "strategies/deepspeed_sp.py", "tiled_core/sequence_group.py", (SB, 42, 50), (SB, 153, 165), (RES, 89, 114)]),
    "hfapply": ("HF apply_tiled_mlp: structural matching (MoE experts included), staged install and rollback", [
        (HF, 1, 88), (HF, 95, 108), "tiled_mlp/integrations/matching.py", (INT, 1, 29)]),
    "report": ("TilingReport", ["tiled_mlp/integrations/report.py"]),
    "flags": ("Flags and config entry: args parsing, enable_tiled_mlp/from_config/from_pretrained, the stack in one "
              "call", [(HF, 109, 167), "tiled_mlp/integrations/args.py", "tiled_mlp/integrations/stack.py"]),
    "axolotl": ("axolotl plugin", ["tiled_mlp/integrations/axolotl.py"]),
    "llamafactory": ("LLaMA-Factory callback", ["tiled_mlp/integrations/llamafactory.py"]),
    "msswift": ("ms-swift plugin", ["tiled_mlp/integrations/ms_swift.py",
                                    "tiled_mlp/integrations/ms_swift_plugin/__init__.py",
                                    "tiled_mlp/integrations/ms_swift_plugin/tiled_mlp_ms_swift.py"]),
    "framework_common": ("Framework entry points' shared checked releases", [
        "tiled_mlp/integrations/framework_settings.py"]),
    "facade": ("Facade and packaging: tiled_mlp/__init__ (checkout loader, public names), tiled_core/__init__", [
        "tiled_mlp/__init__.py", "tiled_core/__init__.py"]),
}
