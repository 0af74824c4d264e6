"""Pipeline and hybrid parallel training of Hugging Face causal LMs with DeepSpeed's pipeline engine."""
