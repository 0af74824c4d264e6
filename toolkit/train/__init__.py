"""`python -m toolkit.train`: train a Hugging Face causal LM the way a plan says (HF Trainer for DDP / ZeRO / FSDP2,
toolkit.train.pipeline for pipeline and hybrid plans). Import-light: torch and transformers load only when a run starts."""
