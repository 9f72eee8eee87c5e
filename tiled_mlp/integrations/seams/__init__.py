"""One module per dependency whose internals the stack calls: each holds every such call, the releases they were
checked on, and refuses others when the piece that needs them is applied (``checked_versions.require``)."""
