"""The containers: storage, entries, caches, freezing, hook points, persistence and value kinds.

Nothing here imports TransformerLens or transformers.
"""
