"""toolkit: plan, emit and run distributed training of Hugging Face causal LMs."""

__version__ = "0.1.0"
