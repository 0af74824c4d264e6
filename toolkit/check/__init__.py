"""`toolkit check`'s findings, cut along its seams: reading files safely (read), the finding type and runner names
(findings), DeepSpeed JSON (deepspeed), accelerate YAML (accelerate), whether the model fits (fit), and a plan
folder's files against its plan.json (folder). The command itself and its output are toolkit.commands.check."""
