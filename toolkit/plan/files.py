"""The plan folder's file names, one constant each: what `toolkit plan --out` and `toolkit emit` write, and what
launch, check, the rehearsal and toolkit.train read back. A name is spelled here and nowhere else in code."""

PLAN_JSON = "plan.json"
PLAN_MD = "PLAN.md"
ACCELERATE_CONFIG = "accelerate_config.yaml"
DS_CONFIG = "ds_config.json"
"""The DeepSpeed JSON the runners read (ZeRO plans leave the runner-filled keys "auto")."""
DS_CONFIG_CONCRETE = "ds_config.deepspeed.json"
"""ZeRO plans: every value concrete, for DeepSpeed's own launcher and deepspeed.initialize."""
TRAINING_ARGS = "training_args.json"
LAUNCH_SH = "launch.sh"
SLURM_SBATCH = "slurm.sbatch"
DEEPSPEED_SH = "deepspeed.sh"
HOSTFILE = "hostfile"
MEMORY_CHART = "memory_vs_seq.svg"
"""`toolkit plan --seq max`: per-GPU memory against sequence length, per strategy."""
LEVERS_CHART = "memory_vs_seq_levers.svg"
"""`toolkit plan --seq max`: the same per long-context lever added (toolkit.estimate.levers)."""

EMITTED = (ACCELERATE_CONFIG, DS_CONFIG, DS_CONFIG_CONCRETE, TRAINING_ARGS, LAUNCH_SH, SLURM_SBATCH, DEEPSPEED_SH,
           HOSTFILE, PLAN_JSON, PLAN_MD, MEMORY_CHART, LEVERS_CHART)
"""Every file an emit may write (a plan refuses before planning when any of them exists without --force)."""
