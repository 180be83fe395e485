"""Evaluation: perplexity, the transformers KV cache as measured, sweeps and their plots."""
