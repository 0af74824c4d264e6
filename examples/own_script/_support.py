"""Shared by the three example scripts: their command line, simple data, and a report for the tests. The plan's
settings, and the set-up a machine without a GPU needs, come from toolkit.train.own_script (public), not from here.
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


def packed_blocks(data_dir: str, tokenizer, seq_len: int) -> dict[str, list]:
    """train.txt's paragraphs, tokenized, joined with EOS and cut into seq_len blocks (input_ids, labels)."""
    ids: list[int] = []
    for paragraph in (Path(data_dir) / "train.txt").read_text().split("\n\n"):
        if paragraph.strip():
            ids += tokenizer(paragraph, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    blocks = [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
    return {"input_ids": blocks, "labels": [list(b) for b in blocks]}


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
