"""A meta step whose repeated ops' outputs are remade from what they returned the first time
(``tiled_mlp/planner/meta_outputs.py``, with its one-tensor shortcut) logs every allocation and free of
the step whose every op runs its meta kernel: same order, bytes, kinds and labels."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")


from integration_tests.tiny_models import small_planner_llama  # noqa: E402
from tiled_mlp.planner import timeline as timeline_module  # noqa: E402
from tiled_mlp.planner.meta_outputs import MetaOutputs  # noqa: E402
from tiled_mlp.planner.step import Setting, build_model, step_timeline  # noqa: E402

SETTINGS = [
    Setting(tiled=False, checkpointing=False),
    Setting(tiled=True, checkpointing=True, num_shards=3, tiled_loss=True, loss_num_shards=4),
    Setting(tiled=True, checkpointing=True, num_shards=3, tiled_loss=True, loss_num_shards=4,
            offload_checkpoints=True, tiled_norms=True),
]


class EveryOpRuns:
    """The unshortened computation: each op's meta kernel, every call."""

    def call(self, func, args, kwargs):
        return func(*args, **kwargs)


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.name)
def test_remade_outputs_log_the_step_of_every_kernel_event_for_event(setting, monkeypatch):
    model = build_model(small_planner_llama(2), None, torch.bfloat16, "meta", setting)
    monkeypatch.setattr(timeline_module, "_META_OUTPUTS", EveryOpRuns())
    full = step_timeline(model, 96, 1, describe=True, replay_shards=False)
    kept = MetaOutputs()
    monkeypatch.setattr(timeline_module, "_META_OUTPUTS", kept)
    first = step_timeline(model, 96, 1, describe=True, replay_shards=False)
    remade = step_timeline(model, 96, 1, describe=True, replay_shards=False)  # every op kept by now
    assert any(single[0] == "new" for single in kept._single.values()), "the one-tensor shortcut is not in use"
    if setting.tiled:  # the shards' gradients are accumulated in place
        assert any(single[0] == "arg" for single in kept._single.values()), "no in-place op took the shortcut"
    for shortened in (first, remade):
        assert shortened.events == full.events
        assert shortened.points == full.points and shortened.host == full.host


class ViewsKeyed(MetaOutputs):
    """The cache with view ops keyed like any other: what it keeps for them says whether leaving them
    unkeyed (``MetaOutputs._key``) can change a step."""

    @staticmethod
    def _key(func, args, kwargs):
        if not isinstance(func, torch._ops.OpOverload):
            return None
        from tiled_mlp.planner import meta_outputs

        try:
            return (func, meta_outputs._args_key(args), meta_outputs._key_of(kwargs) if kwargs else None)
        except meta_outputs._NotMeta:
            return None


@pytest.mark.parametrize("setting", SETTINGS[1:], ids=lambda s: s.name)
def test_view_ops_are_never_remembered_so_they_are_not_keyed(setting, monkeypatch):
    model = build_model(small_planner_llama(2), None, torch.bfloat16, "meta", setting)
    keyed = ViewsKeyed()
    monkeypatch.setattr(timeline_module, "_META_OUTPUTS", keyed)
    every = [step_timeline(model, 96, 1, describe=True, replay_shards=False) for _ in range(2)]
    views = {key: spec for key, spec in keyed._kept.items() if key[0].is_view}
    assert views, "the step makes view ops (the shard loops' slices)"
    assert all(spec is None for spec in views.values()), "a view op's output would be remade"
    unkeyed = MetaOutputs()
    monkeypatch.setattr(timeline_module, "_META_OUTPUTS", unkeyed)
    shortened = [step_timeline(model, 96, 1, describe=True, replay_shards=False) for _ in range(2)]
    assert not any(key[0].is_view for key in unkeyed._kept), "view ops are keyed"
    for short, full in zip(shortened, every, strict=True):
        assert short.events == full.events and short.points == full.points and short.host == full.host
