"""toolkit.train --compile: real 2-process runs over gloo with the model torch.compile'd (inductor, C++ on CPU),
checked against one eager single-process run of the same job.

The tiny Llama of tests/test_train_engines.py with one decoder layer instead of two, and the same corpus, global
batch and seed; fewer steps. Every rank compiles the model, and compiling, not training, is the run: 3 steps took
1.4 s eager and 52 / 77 / 102 s compiled under DDP / ZeRO-2 / FSDP2 (train_runtime, box loaded; FSDP2's per-layer
hooks break the graph, 19 graphs a rank). The second layer is the first one's code again: it adds graphs to compile
and nothing to what the comparison proves (each engine's compiled forward, backward and update of a decoder layer,
its wrapping and the layers around it, against eager). Compiled kernels fuse and reorder floating-point work, so
losses agree to COMPILE_TOLERANCE rather than the engines' 2e-4.

The four runs are independent, so they start side by side (each world on a port of its own): one after the other
they kept about one of two cores busy (the eager run is one process; a compiled world's ranks leave the second core
idle for much of their run). Measured here, inductor's cache warm, box loaded: 277 s one after the other, 162 s
side by side, for the same CPU time.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import shared_tiny_model
from toolkit.run.rehearsal import plan_for_model

STEPS = 3
SEQ = 32
COMPILE_TOLERANCE = 1e-3
COMMON = ("--max-steps", str(STEPS), "--logging-steps", "1", "--save-steps", "100", "--lr", "3e-3",
          "--lr-scheduler", "constant", "--seed", "7", "--eval-fraction", "0", "--no-save-final")


def _plan(model_dir, strategy, *, world=2, micro=2, accum=1):
    return plan_for_model(model_dir, strategy, gpus_per_node=world, micro_batch=micro, grad_accum=accum,
                          seq_len=SEQ, precision="fp32")


@pytest.fixture(scope="module")
def one_layer_llama_dir() -> Path:
    """tiny_llama_dir's Llama (hidden 64, 256 positions, its tokenizer's corpus) with 1 decoder layer."""
    return shared_tiny_model("llama", layers=1, hidden=64, corpus_chars=100_000)


@pytest.mark.multiprocess
def test_compiled_training_matches_eager_losses_under_ddp_zero2_and_fsdp2(runs_side_by_side, one_layer_llama_dir,
                                                                         corpus_dir, monkeypatch):
    # Each rank compiles in its own process (no pool of compile workers, each an interpreter importing torch, per
    # rank on two cores): the kernels are the same.
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    engines = (("ddp", 2, 1), ("zero2", 1, 2), ("fsdp2", 2, 1))
    runs = runs_side_by_side(
        {"eager": (_plan(one_layer_llama_dir, "ddp", world=1, micro=4), "eager", "--data", str(corpus_dir), *COMMON),
         **{strategy: (_plan(one_layer_llama_dir, strategy, micro=micro, accum=accum), f"compiled-{strategy}", "--data",
                       str(corpus_dir), *COMMON, "--compile") for strategy, micro, accum in engines}},
        timeout=1200)
    eager = runs.pop("eager").check().losses()
    assert len(eager) == STEPS
    for strategy, run in runs.items():
        run.check()
        assert all(rank["compiled_graphs"] > 0 for rank in run.ranks), strategy
        got = run.losses()
        assert got.keys() == eager.keys(), (strategy, got)
        for step in eager:
            assert got[step] == pytest.approx(eager[step], abs=COMPILE_TOLERANCE), (strategy, step, got, eager)
