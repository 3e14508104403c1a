"""The TransformerBridge adapter: TransformerLens' bridge over a HuggingFace model, through an `HFKeyValueCache`; the only code that imports `TransformerBridge`."""
