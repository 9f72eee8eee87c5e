"""Imported by ``swift sft --external_plugins <this file>`` (see ``tiled_mlp.integrations.ms_swift``)."""
from tiled_mlp.integrations.ms_swift import install

install()
