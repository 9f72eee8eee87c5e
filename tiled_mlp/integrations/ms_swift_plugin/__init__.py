"""The file ms-swift's ``--external_plugins`` imports (``tiled_mlp_ms_swift.py``), in a folder of its own."""
