"""Evaluation: perplexity, text data, the transformers KV cache as measured, sweeps and their plots."""
