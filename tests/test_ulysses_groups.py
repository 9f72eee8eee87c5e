"""The SP forward guard's refusal of a batch of another size names the fixes, the short last batch of an
epoch included (it arrives late in training, where a DataLoader keeps it)."""
import pytest
import torch
from torch import nn

from tiled_mlp.integrations.ulysses import guard_inputs


class Takes(nn.Module):
    def forward(self, input_ids=None, position_ids=None):
        return input_ids


def test_a_short_last_batch_is_refused_naming_drop_last():
    model = Takes()
    guard_inputs(model, micro_batch_size=4)
    model(input_ids=torch.zeros(4, 8, dtype=torch.long), position_ids=torch.arange(8)[None])
    with pytest.raises(ValueError, match="micro_batch_size=3") as raised:
        model(input_ids=torch.zeros(3, 8, dtype=torch.long), position_ids=torch.arange(8)[None])
    assert "dataloader_drop_last=True" in str(raised.value) and "drop_last=True" in str(raised.value)
