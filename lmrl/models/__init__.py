"""Models: loading Hugging Face causal LMs, tokenizers, reward models, critics and the sampler copy; the shipped tiny model."""
