"""The ``tiled-mlp`` command: bench, plan, demo."""
