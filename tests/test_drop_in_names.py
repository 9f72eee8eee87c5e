"""Tiling is a drop-in: nothing that names a parameter, buffer or module sees it.

``TiledMLP(mlp)`` tiles ``mlp`` in place (the same object, its class swapped to a subclass of both
``TiledMLP`` and the original class), so ``named_parameters()``, ``named_buffers()``,
``named_modules()`` and ``state_dict()`` give the same names tiled or not, and code that keys on those
names (optimizer groups by name, PEFT's ``save_pretrained``, checkpoint tools) works unchanged. A
wrapper that held the MLP as a child would add an infix (``mlp.mlp.``) to every name under it.
"""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
from reference import GatedMLP, max_rel_error
from torch import nn

from integration_tests.toy_models import ScaledBlock
from tiled_mlp import TiledMLP, apply_tiled_mlp, remove_tiled_mlp

pytest.importorskip("transformers")

from integration_tests.tiny_models import VOCAB, tiny_model, token_ids  # noqa: E402

pytestmark = pytest.mark.timeout(60)

HIDDEN, INTER, LAYERS = 8, 12, 2
# phi3: one fused gate_up_proj; mixtral: the fused experts are what gets tiled, not the whole block.
HF_FAMILIES = ("llama", "qwen2", "gemma2", "phi3", "mixtral")


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(ScaledBlock(HIDDEN, GatedMLP(HIDDEN, INTER), 0.5) for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def stack(seed=0):
    torch.manual_seed(seed)
    return Stack().double()


def build_named(name):
    return stack() if name == "stack" else tiny_model(name)


def names(model):
    """Every list of names that code outside the library may key on, in order."""
    return {
        "parameters": [n for n, _ in model.named_parameters()],
        "buffers": [n for n, _ in model.named_buffers()],
        # Modules that own tensors directly: the names optimizers, PEFT and FSDP wrap policies see.
        # (A tensor-free helper module would be harmless, so only these are compared.)
        "modules": [n for n, m in model.named_modules() if next(m.parameters(recurse=False), None) is not None],
        "state_dict": list(model.state_dict()),
    }


def assert_same_names(want, got, when):
    for kind in want:
        extra = [n for n in got[kind] if n not in want[kind]]
        missing = [n for n in want[kind] if n not in got[kind]]
        assert got[kind] == want[kind], f"{when}: {kind} names differ; new {extra[:4]}, gone {missing[:4]}"


def num_tiled(model):
    return sum(isinstance(m, TiledMLP) for m in model.modules())


# -- names ------------------------------------------------------------------------------------------------
def test_tiling_is_in_place():
    """The documented contract the name tests rest on: the same object, both classes."""
    mlp = GatedMLP(HIDDEN, INTER)
    tiled = TiledMLP(mlp, num_shards=2)
    assert tiled is mlp
    assert isinstance(tiled, TiledMLP) and isinstance(tiled, GatedMLP)


@pytest.mark.parametrize("name", HF_FAMILIES + ("stack",))
def test_apply_keeps_every_name(name):
    model = build_named(name)
    before = names(model)
    apply_tiled_mlp(model, num_shards=2)
    assert num_tiled(model) == LAYERS  # something was tiled, so the comparison means something
    assert_same_names(before, names(model), "after apply_tiled_mlp")


@pytest.mark.parametrize("name", HF_FAMILIES + ("stack",))
def test_manual_tiling_keeps_every_name(name):
    model = build_named(name)
    before = names(model)
    # The assignment back is how a wrapper API is called; tiling in place makes it a no-op.
    if name == "stack":
        for layer in model.layers:
            layer.mlp = TiledMLP(layer.mlp, num_shards=2)
    else:
        layer = model.model.layers[0]
        layer.mlp = TiledMLP(layer.mlp, num_shards=2)
    assert num_tiled(model) >= 1
    assert_same_names(before, names(model), "after TiledMLP(...)")


@pytest.mark.parametrize("name", HF_FAMILIES + ("stack",))
def test_remove_restores_the_same_objects_and_classes(name):
    model = build_named(name)
    before = names(model)
    modules = [(n, id(m), type(m)) for n, m in model.named_modules()]
    apply_tiled_mlp(model, num_shards=2)
    assert num_tiled(model) == LAYERS
    remove_tiled_mlp(model)
    # Same module objects under the same names, each of its original class again: no wrapper left
    # behind, no copy made.
    assert [(n, id(m), type(m)) for n, m in model.named_modules()] == modules
    assert num_tiled(model) == 0
    assert_same_names(before, names(model), "after remove_tiled_mlp")


# -- same computation ---------------------------------------------------------------------------------------
def test_tiled_llama_logits_and_grads_match_untiled_by_name():
    reference = tiny_model("llama")
    tiled = copy.deepcopy(reference)
    apply_tiled_mlp(tiled, num_shards=3)
    ids = token_ids(1)
    cotangent = torch.randn(2, 13, VOCAB, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    logits = {}
    for label, model in (("reference", reference), ("tiled", tiled)):
        out = model(input_ids=ids, labels=ids)
        # A random cotangent on the logits reaches every position, on top of the loss.
        (out.loss + (out.logits * cotangent).sum()).backward()
        logits[label] = out.logits.detach()
    assert max_rel_error(logits["reference"], logits["tiled"]) <= 1e-10
    # Gradients paired by parameter name: the tiled model must have the same names to be compared.
    assert_same_names(names(reference), names(tiled), "tiled llama")
    want, got = dict(reference.named_parameters()), dict(tiled.named_parameters())
    for key, param in want.items():
        assert param.grad is not None and got[key].grad is not None, key
        assert max_rel_error(param.grad, got[key].grad) <= 1e-10, key
    assert all(want[k].grad.abs().max() > 0 for k in want if ".mlp." in k)


# -- attributes ---------------------------------------------------------------------------------------------
def test_assigned_projection_is_used_and_saved():
    torch.manual_seed(0)
    reference = GatedMLP(HIDDEN, INTER).double()
    tiled = TiledMLP(copy.deepcopy(reference), num_shards=3)
    replacement = nn.Linear(INTER, HIDDEN, bias=False).double()
    tiled.down_proj = replacement
    reference.down_proj = copy.deepcopy(replacement)
    assert tiled.down_proj is replacement

    x = torch.randn(2, 7, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    # The next forward computes with the new projection, as the untiled module with the same one does.
    want, got = reference(x), tiled(x)
    error = max_rel_error(want.detach(), got.detach())
    assert error <= 1e-12, f"the forward did not compute with the assigned down_proj (relative error {error:.3g})"
    # The backward delivers the new projection's gradient to it (the tiled backward re-reads the weights).
    dy = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    want.backward(dy)
    got.backward(dy)
    assert replacement.weight.grad is not None
    assert max_rel_error(reference.down_proj.weight.grad, replacement.weight.grad) <= 1e-12
    # ... and the new projection is the one saved, under the untiled key, and the only one.
    state = tiled.state_dict()
    assert list(state) == list(reference.state_dict())
    assert state["down_proj.weight"].data_ptr() == replacement.weight.data_ptr()
    params = dict(tiled.named_parameters())
    assert params["down_proj.weight"] is replacement.weight
    assert tiled.gate_proj.weight is params["gate_proj.weight"]  # reads reach the MLP's own children


# -- copies -------------------------------------------------------------------------------------------------
def _torch_round_trip(model, tmp_path):
    path = tmp_path / "model.pt"
    torch.save(model, path)
    return torch.load(path, weights_only=False)


COPIES = {
    "deepcopy": lambda model, tmp_path: copy.deepcopy(model),
    "pickle": lambda model, tmp_path: pickle.loads(pickle.dumps(model)),
    "torch.save": _torch_round_trip,
}


@pytest.mark.parametrize("how", COPIES)
def test_copies_stay_tiled_and_equal(how, tmp_path):
    model = tiny_model("llama")
    untiled_names = names(model)
    apply_tiled_mlp(model, num_shards=3)
    ids = token_ids(4)
    with torch.no_grad():
        want = model(input_ids=ids).logits
    clone = COPIES[how](model, tmp_path)
    assert clone is not model
    assert all(isinstance(layer.mlp, TiledMLP) for layer in clone.model.layers)
    assert_same_names(untiled_names, names(clone), f"after {how}")
    with torch.no_grad():
        got = clone(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    # The copy is independent: its parameters are not the original's.
    assert clone.model.layers[0].mlp.down_proj.weight is not model.model.layers[0].mlp.down_proj.weight


# -- PEFT -----------------------------------------------------------------------------------------------------
MLP_ADAPTERS = ("gate_proj", "up_proj", "down_proj")


def _lora_config(peft):
    return peft.LoraConfig(target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"], r=2, lora_alpha=4,
                           init_lora_weights=False)


def _peft_run(order, directory):
    """LoRA on tiny llama, tiled in ``order`` ("untiled" for the reference), one AdamW step, saved."""
    peft = pytest.importorskip("peft")
    base = tiny_model("llama")
    if order == "tile_then_lora":
        apply_tiled_mlp(base, num_shards=2)
    torch.manual_seed(7)  # the random (init_lora_weights=False) adapter weights, the same in every run
    model = peft.get_peft_model(base, _lora_config(peft))
    if order == "lora_then_tile":
        apply_tiled_mlp(model, num_shards=2)
    assert num_tiled(model) == (0 if order == "untiled" else LAYERS)

    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = token_ids(5)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    model.save_pretrained(directory)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=token_ids(6)).logits
    return model, logits


@pytest.mark.parametrize("order", ["tile_then_lora", "lora_then_tile"])
def test_peft_saves_and_reloads_every_adapter(order, tmp_path):
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    untiled, _ = _peft_run("untiled", tmp_path / "untiled")
    tiled, tiled_logits = _peft_run(order, tmp_path / "tiled")
    want = load_file(tmp_path / "untiled" / "adapter_model.safetensors")
    got = load_file(tmp_path / "tiled" / "adapter_model.safetensors")

    # The reference saves lora_A and lora_B of gate/up/down in every layer (and of q_proj).
    mlp_keys = {k for k in want if ".mlp." in k}
    assert len(mlp_keys) == 2 * len(MLP_ADAPTERS) * LAYERS, sorted(want)
    assert all(any(f".{proj}.lora_" in k for proj in MLP_ADAPTERS) for k in mlp_keys)
    # The tiled run saves exactly those keys: no MLP adapter lost, none under another name.
    assert sorted(got) == sorted(want), f"missing {sorted(set(want) - set(got))}, extra {sorted(set(got) - set(want))}"
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-8, msg=key)
    # The trainable parameters are named as untiled too (optimizer groups, logging by name).
    trainable = lambda m: [n for n, p in m.named_parameters() if p.requires_grad]  # noqa: E731
    assert trainable(tiled) == trainable(untiled)

    # The saved adapter, loaded into a fresh untiled model, computes what the trained tiled model does.
    reloaded = peft.PeftModel.from_pretrained(tiny_model("llama"), tmp_path / "tiled")
    reloaded.eval()
    assert num_tiled(reloaded) == 0
    with torch.no_grad():
        reloaded_logits = reloaded(input_ids=token_ids(6)).logits
    assert max_rel_error(tiled_logits, reloaded_logits) <= 1e-10
