"""Whole-model planning: the peak memory of one training step of a decoder model, untiled vs tiled,
with and without checkpointing, per rank of a backend, and the longest sequence a budget allows."""
