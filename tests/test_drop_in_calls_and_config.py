"""Ways of calling, rebinding, sharing, configuring and reloading a tiled module: each behaves as the
untiled module does, or is refused before anything is changed.

Each numeric comparison runs float64 against an untiled deep copy: output, input gradient and every
parameter gradient.
"""
from __future__ import annotations

import copy
import inspect
import types

import pytest
import torch
from reference import GatedMLP, assert_runs_close, fresh_inputs, seeded, step
from torch import nn

from tiled_mlp import TiledMLP
from tiled_mlp.integrations import apply_tiled_mlp, enable_tiled_mlp, from_config, from_pretrained, remove_tiled_mlp

pytestmark = pytest.mark.timeout(60)

HIDDEN, INTER, TOKENS = 16, 32, 30
SHAPE = (2, TOKENS, HIDDEN)
TOL = 1e-10


def tiny(family: str) -> nn.Module:
    pytest.importorskip("transformers")
    from integration_tests.tiny_models import tiny_model

    return tiny_model(family)


def count_tiled(model: nn.Module) -> int:
    return sum(isinstance(m, TiledMLP) for m in model.modules())


def signature_of(forward) -> list:
    return [(p.name, p.kind, p.default) for p in inspect.signature(forward).parameters.values()]


# -- the input passed by its keyword -----------------------------------------------------------------
class HiddenStatesMLP(GatedMLP):
    def forward(self, hidden_states):
        return self.down_proj(self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))


def phi3_mlp() -> nn.Module:
    return copy.deepcopy(tiny("phi3").model.layers[0].mlp)


@pytest.mark.parametrize("builder", [lambda: seeded(HiddenStatesMLP, 0, HIDDEN, INTER), phi3_mlp],
                         ids=["hidden_states-class", "phi3"])
def test_the_input_by_its_keyword_after_tiling(builder):
    mlp = builder()
    before = signature_of(mlp.forward)
    assert [name for name, *_ in before] == ["hidden_states"]
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=1)
    want = step(copy.deepcopy(mlp), x, dy, keyword="hidden_states")

    tiled = TiledMLP(mlp, num_shards=3)
    assert signature_of(tiled.forward) == before
    got = step(tiled, x, dy, keyword="hidden_states")
    assert_runs_close(want, got, tol=TOL)
    assert tiled.tiling.last_path in ("fast", "generic") and tiled.tiling.last_num_shards == 3


@pytest.mark.parametrize("builder", [lambda: seeded(HiddenStatesMLP, 0, HIDDEN, INTER), phi3_mlp],
                         ids=["hidden_states-class", "phi3"])
def test_a_wrong_keyword_raises_type_error_as_untiled(builder):
    mlp = builder()
    x = torch.randn(SHAPE, dtype=torch.float64)
    with pytest.raises(TypeError):
        copy.deepcopy(mlp)(h=x)
    tiled = TiledMLP(mlp, num_shards=3)
    with pytest.raises(TypeError):
        tiled(h=x)


# -- a forward bound on the instance after tiling -----------------------------------------------------
def half_forward(self, x):
    half_forward.token_counts.append(x.numel() // x.shape[-1])
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * 0.5)


half_forward.token_counts = []


def bind_through_dict(module):
    # What Liger's _bind_method_to_module does.
    module.__dict__["forward"] = types.MethodType(half_forward, module)


def bind_by_setattr(module):
    module.forward = types.MethodType(half_forward, module)


@pytest.mark.parametrize("bind", [bind_through_dict, bind_by_setattr], ids=["__dict__", "setattr"])
def test_a_forward_bound_on_the_instance_after_tiling_is_tiled_through(bind):
    mlp = seeded(GatedMLP, 2, HIDDEN, INTER)
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=2)
    ref = copy.deepcopy(mlp)
    bind(ref)
    want = step(ref, x, dy)

    tiled = TiledMLP(copy.deepcopy(mlp), num_shards=4)
    bind(tiled)
    half_forward.token_counts.clear()
    got = step(tiled, x, dy)
    assert_runs_close(want, got, tol=TOL)
    assert tiled.tiling.last_path in ("fast", "generic")
    assert tiled.tiling.last_num_shards == 4
    # Tiled through: the new forward ran shard by shard, never on all the tokens at once.
    assert half_forward.token_counts and max(half_forward.token_counts) < SHAPE[0] * SHAPE[1]


# -- one MLP shared by two parents ----------------------------------------------------------------
def test_an_mlp_shared_by_two_layers_is_tiled_once_and_removed_cleanly():
    from integration_tests.tiny_models import VOCAB, grads_by_key

    model = tiny("llama")
    model.model.layers[1].mlp = model.model.layers[0].mlp
    shared = model.model.layers[0].mlp
    original_class = type(shared)
    reference = copy.deepcopy(model)  # deepcopy keeps the sharing

    apply_tiled_mlp(model, num_shards=3)
    assert model.model.layers[1].mlp is shared and isinstance(shared, TiledMLP)
    assert count_tiled(model) == 1  # once: one remove below gives back the original class

    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, 13), generator=generator)
    cotangent = torch.randn(2, 13, VOCAB, generator=generator, dtype=torch.float64)
    want = reference(input_ids=ids).logits
    (want * cotangent).sum().backward()
    got = model(input_ids=ids).logits
    (got * cotangent).sum().backward()
    assert shared.tiling.last_num_shards == 3
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    want_grads, got_grads = grads_by_key(reference), grads_by_key(model)
    assert want_grads.keys() == got_grads.keys()
    for key, g in want_grads.items():
        assert (g is None) == (got_grads[key] is None), key
        if g is not None:
            torch.testing.assert_close(got_grads[key], g, rtol=1e-9, atol=1e-12, msg=key)

    remove_tiled_mlp(model)
    assert count_tiled(model) == 0
    assert type(shared) is original_class and not hasattr(shared, "tiling")
    assert model.model.layers[1].mlp is shared


# -- apply_tiled_mlp failing partway -------------------------------------------------------------------
class TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([GatedMLP(HIDDEN, INTER), GatedMLP(HIDDEN, INTER)])

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def test_apply_failing_on_the_second_block_leaves_the_model_unchanged():
    torch.manual_seed(4)
    model = TwoBlocks().double()
    model.blocks[1].tiling = "the user's own attribute"
    with pytest.raises(TypeError, match="already has attributes named"):
        apply_tiled_mlp(model, num_shards=3)
    assert count_tiled(model) == 0
    assert type(model.blocks[0]) is GatedMLP and "tiling" not in model.blocks[0].__dict__
    assert model.blocks[1].tiling == "the user's own attribute"


def test_attributes_another_library_adds_to_every_module_class_do_not_block_tiling():
    # DeepSpeed's zero.Init (HF from_pretrained under ZeRO-3) leaves ``_old_init`` on every nn.Module subclass
    # that defines __init__, TiledMLP and the module's class alike: not a name tiling adds. A name tiling does add
    # (a method of the mixin) is still refused where the module has it.
    added = [cls for cls in (TiledMLP, GatedMLP) if "_old_init" not in vars(cls)]
    for cls in added:
        cls._old_init = cls.__init__
    try:
        tiled = TiledMLP(GatedMLP(HIDDEN, INTER).double(), num_shards=2)
        x, dy = fresh_inputs((2, 5, HIDDEN), HIDDEN)
        tiled(x).backward(dy)
        assert tiled.tiling.last_num_shards == 2
    finally:
        for cls in added:
            del cls._old_init
    mlp = GatedMLP(HIDDEN, INTER)
    mlp.tiled_inputs = "the user's own attribute"
    with pytest.raises(TypeError, match=r"already has attributes named \['tiled_inputs'\]"):
        TiledMLP(mlp)


def test_a_module_that_ran_under_a_backend_with_a_process_group_is_copied_and_pickled():
    # Under DDP the last call's strategy holds DDP's process group, which cannot be pickled (a lock stands in
    # for it): deepcopy (an EMA copy) and torch.save(model) work as untiled, and the copy resolves its own.
    import pickle
    import threading

    from tiled_mlp.strategies import DDPStrategy

    tiled = TiledMLP(GatedMLP(HIDDEN, INTER).double(), num_shards=2)
    x, dy = fresh_inputs((2, 5, HIDDEN), HIDDEN)
    tiled(x).backward(dy)
    for field in ("last_strategy", "forward_strategy"):
        tiled.tiling.__dict__[field] = DDPStrategy(process_group=threading.Lock())
    copied = copy.deepcopy(tiled)
    pickle.loads(pickle.dumps(tiled))
    assert copied.tiling.last_strategy is None and isinstance(tiled.tiling.last_strategy, DDPStrategy)
    copied(x)
    assert copied.tiling.last_strategy is not None


# -- a refused configuration ---------------------------------------------------------------------
class FcMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(HIDDEN, INTER), nn.GELU(), nn.Linear(INTER, HIDDEN)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


@pytest.mark.parametrize("builder", [lambda: nn.Sequential(nn.Linear(HIDDEN, INTER), nn.GELU(), nn.Linear(INTER, HIDDEN)),
                                     FcMLP], ids=["sequential", "fc1-act-fc2"])
def test_path_fast_on_a_module_without_gated_activation_is_refused_at_tiling(builder):
    torch.manual_seed(5)
    mlp = builder().double()
    original_class = type(mlp)
    with pytest.raises(ValueError):
        TiledMLP(mlp, path="fast", num_shards=2)
    assert type(mlp) is original_class and not hasattr(mlp, "tiling")
    x = torch.randn(SHAPE, dtype=torch.float64)
    assert mlp(x).shape == SHAPE


# -- the configuration is checked when it is set --------------------------------------------------
@pytest.mark.parametrize("attr, value", [("path", "bogus"), ("num_shards", 0), ("num_shards", 2.5),
                                         ("num_shards", -1), ("num_shards", "many"), ("num_shards", True)])
def test_a_bad_setting_on_tiling_raises_and_keeps_the_old_one(attr, value):
    # The error TiledMLP(...) itself raises for this value (ValueError, or TypeError for a non-int).
    with pytest.raises((ValueError, TypeError)) as at_tiling:
        TiledMLP(seeded(GatedMLP, 6, HIDDEN, INTER), **{attr: value})
    tiled = TiledMLP(seeded(GatedMLP, 6, HIDDEN, INTER), num_shards=3, path="generic")
    before = getattr(tiled.tiling, attr)
    with pytest.raises(at_tiling.type):
        setattr(tiled.tiling, attr, value)
    assert getattr(tiled.tiling, attr) == before
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=6)
    step(tiled, x, dy)  # still usable
    assert tiled.tiling.last_num_shards == 3 and tiled.tiling.last_path == "generic"


def test_good_settings_on_tiling_are_taken():
    tiled = TiledMLP(seeded(GatedMLP, 6, HIDDEN, INTER), num_shards=3)
    tiled.tiling.path = "generic"
    tiled.tiling.num_shards = 5
    x, dy = fresh_inputs(SHAPE, HIDDEN, seed=7)
    step(tiled, x, dy)
    assert (tiled.tiling.last_path, tiled.tiling.last_num_shards) == ("generic", 5)
    tiled.tiling.num_shards = "auto"
    assert tiled.tiling.num_shards == "auto"


# -- from_pretrained / from_config keep the saved path -----------------------------------------------
def test_from_pretrained_with_a_shard_count_keeps_the_saved_path(tmp_path):
    pytest.importorskip("transformers")
    from transformers import LlamaForCausalLM

    model = tiny("llama")
    enable_tiled_mlp(model.config, num_shards=3, path="generic")
    model.save_pretrained(tmp_path / "ckpt")

    reloaded = from_pretrained(LlamaForCausalLM, tmp_path / "ckpt", use_tiled_mlp=True, tiled_mlp_num_shards=5)
    tilings = [layer.mlp.tiling for layer in reloaded.model.layers]
    assert [(t.path, t.num_shards) for t in tilings] == [("generic", 5)] * len(tilings)


def test_from_config_with_a_shard_count_keeps_the_configured_path():
    pytest.importorskip("transformers")
    from transformers import LlamaForCausalLM

    config = copy.deepcopy(tiny("llama").config)
    enable_tiled_mlp(config, num_shards=3, path="generic")
    built = from_config(LlamaForCausalLM, config, use_tiled_mlp=True, tiled_mlp_num_shards=5)
    tilings = [layer.mlp.tiling for layer in built.model.layers]
    assert [(t.path, t.num_shards) for t in tilings] == [("generic", 5)] * len(tilings)


def test_a_shard_count_given_alone_replaces_the_saved_one_or_is_refused(tmp_path):
    # Without use_tiled_mlp, the count applies where the config asks for tiling; where nothing does, it is refused
    # rather than dropped.
    pytest.importorskip("transformers")
    from transformers import LlamaForCausalLM

    model = tiny("llama")
    enable_tiled_mlp(model.config, num_shards=2)
    model.save_pretrained(tmp_path / "ckpt")
    reloaded = from_pretrained(LlamaForCausalLM, tmp_path / "ckpt", tiled_mlp_num_shards=4)
    assert {layer.mlp.tiling.num_shards for layer in reloaded.model.layers} == {4}
    with pytest.raises(ValueError, match="nothing asks for tiling"):
        from_config(LlamaForCausalLM, copy.deepcopy(tiny("llama").config), tiled_mlp_num_shards=4)


def test_a_bad_setting_with_path_fast_is_reported_as_itself():
    """apply_tiled_mlp lists the blocks path='fast' cannot take; a bad shard count is another error."""
    model = tiny("llama")
    with pytest.raises(ValueError, match=r"^num_shards must be >= 1"):
        apply_tiled_mlp(model, num_shards=0, path="fast")
    assert not any(isinstance(m, TiledMLP) for m in model.modules())
