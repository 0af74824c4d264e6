"""What the user gives, and the grid over it: the model's config (modelconfig), its shape
(modelspec) and the attention its class runs (attention), what the model's own tp_plan shards
(tensorplan), the GPUs (hardware), the strategy, LoRA / QLoRA adapters (lora), the job rules (job), the process grid
(grid), the pipeline partition maths (partition) and the one model-name resolver (resolve). Values and rules;
nothing here runs a process or writes a file, and nothing here imports from the wings above (plan, estimate, ...)."""
