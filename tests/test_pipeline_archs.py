"""Every decoder architecture the converter finds the parts of (toolkit.inputs.decoder_parts) trains as a 2-stage
DeepSpeed pipeline with the losses of the plain single-process HF model: one 2-process launch for all of them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_pipeline_convert import ARCHS, pipeline_test_overrides

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pipeline_losses(tmp_path_factory):
    """{arch: (model folder, losses of the 2-stage pipeline)} from one torchrun launch of tests/pipeline_archs.py."""
    from toolkit.run.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("archs")
    models = {arch: make_tiny_model(arch, root / arch, corpus_chars=20_000, **pipeline_test_overrides(arch))
              for arch in ARCHS}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           str(ROOT / "tests" / "pipeline_archs.py"), str(root / "losses.json"), *map(str, models.values())]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    losses = json.loads((root / "losses.json").read_text())
    return {arch: (models[arch], losses[str(models[arch])]) for arch in ARCHS}


def single_process_losses(model_dir: Path) -> list[float]:
    """The HF model itself, the same batches, optimizer and accumulation (mean of the micro-batches' losses)."""
    from transformers import AutoModelForCausalLM

    from tests.pipeline_archs import ACCUM, LR, STEPS, batches

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for ids, labels in batches(model.config.get_text_config().vocab_size, step):
            loss = model(input_ids=ids, labels=labels).loss / ACCUM
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses


@pytest.mark.multiprocess
@pytest.mark.parametrize("arch", ARCHS)
def test_two_stage_pipeline_matches_single_process_losses(pipeline_losses, arch):
    model_dir, pipeline = pipeline_losses[arch]
    reference = single_process_losses(model_dir)
    assert len(pipeline) == len(reference)
    assert max(abs(a - b) for a, b in zip(pipeline, reference)) <= 1e-3, (pipeline, reference)
    assert reference[-1] < reference[0]  # it trained: the comparison is of moving numbers
