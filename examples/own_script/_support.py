"""Shared by the three example scripts: reading the plan's settings, simple data, and two things only a machine
without a GPU (CI, tests) needs. Nothing here changes how a plan trains on GPUs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def parse_arguments(data_help: str, *, output: bool = True):
    """The examples' own command line: the plan folder, model, data, output and a short schedule."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--plan", help="the plan folder (default: $TOOLKIT_PLAN_DIR)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True, help=data_help)
    if output:
        parser.add_argument("--output", required=True)
    parser.add_argument("--max_steps", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    return parser.parse_args()


def plan_settings(plan_dir: str | None) -> dict:
    """training_args.json of the plan folder (`--plan`, or TOOLKIT_PLAN_DIR set by launch.sh / toolkit launch)."""
    folder = plan_dir or os.environ.get("TOOLKIT_PLAN_DIR")
    if not folder:
        raise SystemExit("pass --plan PLAN_DIR (or start the script with the plan's launch.sh)")
    return json.loads((Path(folder) / "training_args.json").read_text())


def packed_blocks(data_dir: str, tokenizer, seq_len: int) -> dict[str, list]:
    """train.txt's paragraphs, tokenized, joined with EOS and cut into seq_len blocks (input_ids, labels)."""
    ids: list[int] = []
    for paragraph in (Path(data_dir) / "train.txt").read_text().split("\n\n"):
        if paragraph.strip():
            ids += tokenizer(paragraph, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    blocks = [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
    return {"input_ids": blocks, "labels": [list(b) for b in blocks]}


def cpu_training_kwargs(trainer_settings: dict) -> dict:
    """On a machine without a GPU: accelerate's state over gloo first (toolkit.train.cpu), and TrainingArguments
    that use it. On a GPU: the plan's settings unchanged."""
    import torch

    if torch.cuda.is_available():
        return dict(trainer_settings)
    cpu_state()
    accelerator_config = {**trainer_settings.get("accelerator_config", {}), "use_configured_state": True}
    return {**trainer_settings, "use_cpu": True, "accelerator_config": accelerator_config}


def cpu_state() -> None:
    import torch

    if torch.cuda.is_available():
        return
    from toolkit.train.cpu import configure_cpu_state

    engine = ("deepspeed" if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true" else
              "fsdp2" if os.environ.get("ACCELERATE_USE_FSDP") == "true" else "ddp")
    configure_cpu_state(engine)


def report(rank: int, losses: list[float], model, device) -> None:
    """With REPORT_DIR set: this rank's losses and the trained model's logits on a fixed probe (every rank runs the
    forward: ZeRO-3 and FSDP2 gather parameters collectively), so a test can check that the ranks agree."""
    import torch

    folder = os.environ.get("REPORT_DIR")
    if not folder:
        return
    model.eval()
    with torch.no_grad():
        probe = torch.arange(1, 17, device=device).unsqueeze(0)
        logits = model(input_ids=probe).logits.float().cpu()
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / f"rank{rank}.json").write_text(json.dumps({"losses": losses, "probe_logits": logits.tolist()}))


def report_trainer(trainer) -> None:
    """report() for a Trainer (or TRL trainer): its logged losses and trained model."""
    report(trainer.args.process_index, [e["loss"] for e in trainer.state.log_history if "loss" in e], trainer.model,
           trainer.args.device)
