"""Predicting a run before it starts: the activation tracer (tracer, with its parts layerkinds, fakestep, recording
and standins; activations, livebytes, compiled for torch.compile'd steps; the model patches it traces live in
toolkit.patches), what one rank of a tensor / context / sequence grid holds (dimensions), the model states
(states), memory savers (savers), the trace a memory estimate reads, cached and scaled (traces), the per-GPU
breakdown (memory), host RAM (hostram), step time (timing, efficiency), the measured error bands (errorband), the
longest sequence each strategy fits (longest), predicted vs measured on this machine (profile), and the planner:
what the user asks (request), its search over strategies and batch splits (search), the candidates it costs
(candidate) and their ranking (ranking)."""
