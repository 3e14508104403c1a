"""safelens' benchmark suite: safelens and the TransformerLens way, side by side."""
