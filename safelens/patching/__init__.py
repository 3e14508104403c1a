"""Activation-patching sweeps, their engine, metrics and heatmaps."""
