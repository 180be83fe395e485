"""mla-convert: turn MHA/GQA Hugging Face checkpoints into DeepSeek-style Multi-head Latent Attention."""

__version__ = "0.1.0"
