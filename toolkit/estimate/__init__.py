"""Predicting a run before it starts: the activation tracer (tracer, activations, liger, livebytes), the model
states (states), memory savers (savers), the per-GPU breakdown (memory), host RAM (hostram), step time (timing),
the measured error band (errorband), predicted vs measured on this machine (profile), and the planner's search over
strategies and batch splits (search)."""
