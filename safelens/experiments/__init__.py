"""Experiments on a shared prefix: prefill, continuations, generation, ablations, hooked runs and capture."""
