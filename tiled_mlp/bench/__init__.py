"""Benchmarks: exact memory accounting (real or fake tensors), timing ratios, peers, tables and plots."""
