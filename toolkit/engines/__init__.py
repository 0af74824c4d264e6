"""What the installed engines say about a configuration: DeepSpeed's config model, accelerate's loader and launch
validation, transformers' Trainer resolution of "auto" (validate), and what each engine reads or fills in a
DeepSpeed JSON (readers). Knowledge taken from the engines, never copied into tables here."""
