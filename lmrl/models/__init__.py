"""Models: loading Hugging Face causal LMs, tokenizers, reward models, critics; the shipped tiny model."""
