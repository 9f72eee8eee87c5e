"""The seams into other libraries' internals (``tiled_mlp/integrations/seams``): the checked version
ranges and their refusal, and the mask builders adapted to the installed transformers by signature."""
from __future__ import annotations

import warnings

import pytest
import torch

from tiled_mlp.integrations.seams import transformers_internals
from tiled_mlp.strategies import checked_versions
from tiled_mlp.strategies.checked_versions import CheckedRange, UncheckedVersionError

RANGE = CheckedRange("transformers", "5.6.0", "5.25.0")


@pytest.mark.parametrize("version, inside", [
    ("5.6.0", True), ("5.23.0", True), ("5.25.0", True), ("5.25.3", True), ("5.26.0.dev0", False),
    ("5.26.0", False), ("5.5.4", False), ("4.57.6", False), ("6.0.0", False)])
def test_a_range_holds_its_ends_and_the_newest_minor_series(version, inside):
    assert RANGE.contains(version) is inside


@pytest.mark.parametrize("checked, version, inside", [
    # exact: the releases named and their local builds, no later patch (a framework entry point's contract)
    (CheckedRange("axolotl", "0.21.0", exact=True), "0.21.0", True),
    (CheckedRange("axolotl", "0.21.0", exact=True), "0.21.0+cpu", True),
    (CheckedRange("axolotl", "0.21.0", exact=True), "0.21.1", False),
    (CheckedRange("axolotl", "0.21.0", exact=True), "0.21.0rc1", False),
    # open above (ZeRO-3's oldest checked DeepSpeed)
    (CheckedRange("deepspeed", "0.19.8"), "0.19.8", True),
    (CheckedRange("deepspeed", "0.19.8"), "0.20.1+cpu", True),
    (CheckedRange("deepspeed", "0.19.8"), "0.19.0", False),
    (CheckedRange("deepspeed", "0.19.8"), "unknown", False),  # not a version: never inside
])
def test_exact_and_open_ranges(checked, version, inside):
    assert checked.contains(version) is inside


def test_each_kind_of_range_names_itself_and_its_pip_requirement():
    assert (RANGE.describe(), RANGE.pip_requirement()) == ("transformers 5.6.0 to 5.25.x", "transformers>=5.6.0,<5.26")
    exact = CheckedRange("axolotl", "0.21.0", exact=True)
    assert (exact.describe(), exact.pip_requirement()) == ("axolotl 0.21.0", "axolotl==0.21.0")
    above = CheckedRange("deepspeed", "0.19.8")
    assert (above.describe(), above.pip_requirement()) == ("deepspeed >= 0.19.8", "deepspeed>=0.19.8")


def test_outside_the_range_the_refusal_names_both_versions_and_the_fix(monkeypatch):
    monkeypatch.setattr(checked_versions, "installed", lambda package: "5.5.4")
    monkeypatch.delenv(checked_versions.UNCHECKED_ENV, raising=False)
    with pytest.raises(UncheckedVersionError) as refused:
        checked_versions.require(RANGE, "Ulysses sequence parallelism")
    message = str(refused.value)
    for words in ("Ulysses sequence parallelism", "transformers 5.6.0 to 5.25.x", "5.5.4 is installed",
                  "pip install 'transformers>=5.6.0,<5.26'", "TILED_MLP_UNCHECKED_VERSIONS=transformers"):
        assert words in message, (words, message)
    monkeypatch.setattr(checked_versions, "installed", lambda package: None)
    with pytest.raises(UncheckedVersionError, match="needs transformers, which is not installed"):
        checked_versions.require(RANGE, "Ulysses sequence parallelism")


def test_the_environment_turns_the_refusal_into_a_warning(monkeypatch):
    monkeypatch.setattr(checked_versions, "installed", lambda package: "5.26.1")
    monkeypatch.setenv(checked_versions.UNCHECKED_ENV, "deepspeed, transformers")
    with pytest.warns(UserWarning, match="5.26.1 is installed"):
        assert checked_versions.require(RANGE, "a feature named for this test only") == "5.26.1"
    monkeypatch.setenv(checked_versions.UNCHECKED_ENV, "deepspeed")
    with pytest.raises(UncheckedVersionError):
        checked_versions.require(RANGE, "a feature named for this test only")


def test_the_installed_transformers_is_inside_its_checked_range():
    transformers = pytest.importorskip("transformers")
    assert transformers_internals.CHECKED.contains(transformers.__version__), transformers.__version__
    assert transformers_internals.require("this test") == transformers.__version__


def _builder_before_5_24(config, inputs_embeds, attention_mask, cache_position=None, *, past_key_values,
                         position_ids=None):
    return {"past_key_values": past_key_values, "position_ids": position_ids}


def _builder_from_5_24(config, inputs_embeds, attention_mask, cache, position_ids=None, *, past_key_values=None):
    return {"cache": cache, "position_ids": position_ids}


def _builder_of_another_shape(config, input_embeds, attention_mask, cache_position, past_key_values):
    return None


def test_the_cache_argument_is_read_from_the_builder_signature():
    before = transformers_internals._adapt(_builder_before_5_24)
    after = transformers_internals._adapt(_builder_from_5_24)
    assert (before.cache_keyword, after.cache_keyword) == ("past_key_values", "cache")
    positions = torch.arange(4)[None]
    assert before(None, torch.empty(1, 4, 0), None, positions) == {"past_key_values": None, "position_ids": positions}
    assert after(None, torch.empty(1, 4, 0), None, positions) == {"cache": None, "position_ids": positions}
    # Decided once per function: the same adapted builder for the same function.
    assert transformers_internals._adapt(_builder_from_5_24) is after


def test_a_builder_of_another_shape_is_refused_when_adapted_not_when_called():
    with pytest.raises(UncheckedVersionError, match="does not take the arguments the stack passes"):
        transformers_internals._adapt(_builder_of_another_shape)


def test_the_installed_builders_give_hfs_own_masks():
    transformers = pytest.importorskip("transformers")
    from transformers import masking_utils

    config = transformers.MistralConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                                        sliding_window=3)
    config._attn_implementation = "sdpa"
    full, sliding = transformers_internals.mask_builders()
    assert (full.function, sliding.function) == (masking_utils.create_causal_mask,
                                                 masking_utils.create_sliding_window_causal_mask)
    padding = torch.tensor([[0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    embeds = torch.empty(1, 6, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecated keyword passed
        mask = sliding(config, embeds, padding, None)
    assert mask.shape == (1, 1, 6, 6)
    rows, cols = torch.meshgrid(torch.arange(6), torch.arange(6), indexing="ij")
    want = (cols <= rows) & (rows - cols < 3) & padding[0][None, :]
    assert torch.equal(mask[0, 0], want)


def test_deepspeed_0_18_is_refused_when_sequence_parallelism_is_applied(monkeypatch):
    """0.18 wrote its Ulysses wrapper under every attention name and its data-loader adapter all-gathers a 0-d
    tensor that gloo refuses; the seam keeps no adaptation for either, so the release is refused at apply time
    (``check_sequence_parallel`` asks ``require``; ``data_loader`` exists only on an applied handle)."""
    from tiled_mlp.integrations.seams import deepspeed_internals

    monkeypatch.setattr(checked_versions, "installed", lambda package: "0.18.6")
    monkeypatch.delenv(checked_versions.UNCHECKED_ENV, raising=False)
    with pytest.raises(UncheckedVersionError, match="Ulysses .* deepspeed 0.19.8 to 0.19.x; deepspeed 0.18.6"):
        deepspeed_internals.require("Ulysses sequence parallelism")
