"""Imported by ``swift sft --external_plugins <this file>``: tiles the model ms-swift prepares, as
``tiled_mlp.integrations.ms_swift`` describes (flags from ``--model_kwargs`` or the environment)."""
from tiled_mlp.integrations.ms_swift import install

install()
