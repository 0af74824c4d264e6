"""ZeRO-2's gradient partition per rank (toolkit.estimate.zeropartition): DeepSpeed sizes each rank's
grads_in_partition by the whole parameters touching its partition, so a large tensor straddling a border is held
whole by every rank it touches. Checked against the engine's own buffers, and through the estimate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from toolkit.estimate.states import zero_states
from toolkit.estimate.zeropartition import (gradient_elements_per_rank, partition_size, worst_gradient_partition,
                                            zero_gradient_partition)
from toolkit.inputs.job import Job
from toolkit.inputs.modelspec import PARAM_NO_DECAY, resolve_model
from toolkit.inputs.strategy import parse_strategy

# An embedding, two small linears and a head of 16,000 + 1,000 elements: the head touches every partition of 4.
UNEVEN = (1600, 640, 40, 640, 16, 16000, 1000)


def test_a_head_straddling_every_border_is_held_whole_by_every_rank():
    """19,936 elements over 4 ranks: partitions of 4,984; the head (elements 2,936 to 18,936) meets all four."""
    assert partition_size(UNEVEN, 4) == 4984
    assert gradient_elements_per_rank(UNEVEN, 4) == [18936, 16000, 16000, 17000]
    # One rank: the whole group; the flat buffer is padded to 2 x world elements, never a partition short.
    assert gradient_elements_per_rank(UNEVEN, 1) == [19936]
    assert partition_size((3, 4), 4) == 2 and gradient_elements_per_rank((3, 4), 4) == [3, 7, 4, 4]


def test_the_groups_share_one_buffer_per_rank():
    """copy_grads_in_partition sums every group's params_in_partition into one grads_in_partition."""
    assert worst_gradient_partition([UNEVEN, (16, 16, 16, 16)], 4) == 18936 + 16
    assert worst_gradient_partition([(), UNEVEN], 2) == max(gradient_elements_per_rank(UNEVEN, 2))


ENGINE_GRADIENT_PARTITIONS = """
import json, sys, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from toolkit.train.__main__ import compile_muon_never
compile_muon_never()
import deepspeed, deepspeed.comm.comm as ds_comm, deepspeed.utils.groups as ds_groups
world = int(sys.argv[1])
fresh = {k: v for k, v in vars(ds_groups).items() if k.startswith("_") and k.isupper()}
out = []
for rank in range(world):
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    deepspeed.init_distributed(dist_backend="fake")
    model = torch.nn.Sequential(torch.nn.Embedding(100, 16), torch.nn.Linear(16, 40), torch.nn.Linear(40, 16),
                                torch.nn.Linear(16, 1000))
    params = dict(model.named_parameters())
    groups = [{"params": [p for n, p in params.items() if not n.endswith("bias")]},
              {"params": [p for n, p in params.items() if n.endswith("bias")], "weight_decay": 0.0}]
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "reduce_bucket_size": 4096},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    opt, sizes = engine.optimizer, []
    copy = opt.copy_grads_in_partition
    def recorded(param, group_idx=None):
        copy(param, group_idx)
        sizes.append(opt.grads_in_partition.numel())
    opt.copy_grads_in_partition = recorded
    engine.backward(engine(torch.randint(0, 100, (1, 8))).float().pow(2).mean())
    out.append({"allocated": sorted(set(sizes)), "partition_size": [int(n) for n in opt.partition_size]})
    dist.destroy_process_group()
    vars(ds_groups).update(fresh)
    ds_comm.cdb = None
print(json.dumps(out))
"""


@pytest.mark.multiprocess
@pytest.mark.one_core
def test_deepspeed_allocates_each_ranks_gradient_partition_as_predicted():
    """DeepSpeed 0.19.8's ZeRO-2 optimizer built at each rank of a fake world of 4 (torch's fake process group: one
    process, every collective a no-op), two param groups (weights, biases) as the HF Trainer makes: the one
    grads_in_partition each rank allocates in backward (copy_grads_in_partition) is what toolkit predicts for that
    rank, and no rank's is the P/N the estimate counted before."""
    import os
    import subprocess
    import sys

    weights, biases = (1600, 640, 640, 16000), (40, 16, 1000)
    env = {**os.environ, "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, "-c", ENGINE_GRADIENT_PARTITIONS, "4"], env=env, capture_output=True,
                         text=True, check=True).stdout
    ranks = json.loads(out.strip().splitlines()[-1])
    expected = [a + b for a, b in zip(gradient_elements_per_rank(weights, 4), gradient_elements_per_rank(biases, 4))]
    assert [r["partition_size"] for r in ranks] == [[partition_size(weights, 4), partition_size(biases, 4)]] * 4
    assert [r["allocated"] for r in ranks] == [[n] for n in expected]
    assert expected == [19936, 17000, 17000, 17000]  # P/N would be 4,984
    assert max(expected) == worst_gradient_partition([weights, biases], 4)


@pytest.fixture(scope="module")
def llama():
    return resolve_model(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=1000)


def test_the_spec_lists_the_tensors_in_the_models_order_with_the_trainers_no_decay_ones(llama):
    """Embedding first, the untied head last; the HF Trainer leaves the norms (2 a layer + the final one) out of
    weight decay."""
    assert sum(llama.param_numels) == llama.params
    assert llama.param_numels[0] == llama.param_numels[-1] == 1000 * 64
    no_decay = [n for n, k in zip(llama.param_numels, llama.param_kinds) if k & PARAM_NO_DECAY]
    assert no_decay == [64] * (2 * 2 + 1)


def test_zero2_counts_the_worst_ranks_whole_parameters(llama):
    """At 4 ranks (partitions of 50,512) the embedding (64,000 elements, first) and the untied head (last) each meet
    two partitions: rank 1 holds the embedding whole with the first layer and part of the second, 105,088 elements
    in one group (DummyOptim's), 100,992 in the Trainer's two; the estimate counts the larger, in the compute
    dtype, where P/N counted 50,512."""
    assert llama.params == 202_048
    assert gradient_elements_per_rank(llama.param_numels, 4) == [64000, 105088, 101056, 64000]
    worst = zero_gradient_partition(llama, llama.params, 4)
    assert worst == (105_088, 0)  # the plan's: allocated from the head's region on (the earliest, an upper bound)
    s = zero_states(llama.params, Job(seq_len=8), parse_strategy("zero2"), dp=4, hidden=64, largest_layer=0,
                    gradient_partition=worst)
    assert s.backward_gradients == 105_088 * 2 and s.partition_region == 0
    assert "2 B x 105,088 (the rank's whole parameters, 2.08x P/N)" in s.sources[-1]


def test_a_spec_whose_tensors_do_not_add_up_keeps_p_over_n(llama):
    """A rescaled spec (--params) or adapters: the tensors are not the trained ones, so no sizing from them."""
    assert zero_gradient_partition(llama, llama.params - 1, 4) is None
    s = zero_states(1_000_000, Job(seq_len=8), parse_strategy("zero2"), dp=4, hidden=64, largest_layer=0)
    assert s.backward_gradients == 1_000_000 / 4 * 2


def test_zero2_holds_the_heads_whole_gradient_until_the_next_hook_copies_it():
    """A head above reduce_bucket_size skips the IPG bucket: its gradient stays whole until the next parameter's
    hook reduces it into the partition (allocated then, beside it); one within the bucket is copied at once."""
    strategy = parse_strategy("zero2")
    big = zero_states(1_000_000, Job(seq_len=8), strategy, dp=2, hidden=64, largest_layer=0, head_params=64_000)
    small = zero_states(1_000_000, Job(seq_len=8, zero_reduce_bucket=100_000), strategy, dp=2, hidden=64,
                        largest_layer=0, head_params=64_000)
    off = zero_states(1_000_000, Job(seq_len=8), parse_strategy("zero2-offload"), dp=2, hidden=64, largest_layer=0,
                      head_params=64_000)
    assert (big.head_gradient, small.head_gradient, off.head_gradient) == (64_000 * 2, 0.0, 0.0)


@pytest.mark.parametrize("arch", ["gpt2", "falcon-rw-1b.json", "qwen3-0.6b.json", "olmo-2-1124-7b.json"])
def test_the_decay_rule_read_from_source_is_the_trainers_own(arch):
    """toolkit.inputs.decay reads Trainer.get_decay_parameter_names' two lists from the installed trainer.py instead
    of importing the Trainer (~2.9 CPU-s): the names it gives are the Trainer's own on models whose norms are
    nn.LayerNorm (gpt2's ln_1, Falcon's) or caught only by name (Qwen3's and OLMo-2's RMSNorm, q_norm / k_norm)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer

    from toolkit.inputs.decay import _trainer_rule, decay_parameter_names

    if arch.endswith(".json"):
        data = json.loads((Path(__file__).parent / "arch_configs" / arch).read_text())
        config = AutoConfig.for_model(**{**data, "num_hidden_layers": 2})
    else:
        config = AutoConfig.for_model(arch, n_layer=2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert _trainer_rule() is not None  # read from the source, not the fallback
    ours = decay_parameter_names(model)
    assert ours == set(Trainer.get_decay_parameter_names(None, model))
    names = [n for n, _ in model.named_parameters()]
    assert 0 < len(ours) < len(names)  # both groups non-empty: norms and biases left out, weights in
