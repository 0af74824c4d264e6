"""The plan: plan.json's schema (schema, with its published JSON Schema plan.schema.json), the one way a Plan is
built from a model, a grid and a job (build), the plan folder's file names (files), and the model, hardware and job
a plan describes (job). Everything after planning (emit, check, launch, train) reads a plan through here."""
