"""lmstack: run Hugging Face-format causal language models from their checkpoint directory."""
