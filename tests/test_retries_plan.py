"""A plan at its GPU's capacity: the replay's allocator retries priced in the step the planner ranks
(toolkit.estimate.retries.at_capacity, called by toolkit.estimate.search.evaluate)."""

from __future__ import annotations

from dataclasses import replace

from toolkit.estimate.retries import retry_cost
from toolkit.estimate.search import evaluate
from toolkit.inputs.grid import grid_of
from toolkit.inputs.hardware import parse_hardware
from toolkit.inputs.job import Job
from toolkit.inputs.modelspec import resolve_model
from toolkit.inputs.strategy import parse_strategy

MiB = 1 << 20


def test_a_plan_the_uncapped_replay_puts_over_its_gpu_runs_with_retries_priced(tiny_llama_dir, tmp_path, monkeypatch):
    """FSDP2's streams keep their own cached segments (10 MiB reserved for a 4.7 MiB tensor peak): on a GPU that
    leaves the allocator 0.25 MiB less than that (4 of its 2 MiB segments), the capped replay flushes the cache twice a step and runs. Before,
    the plan was refused ('needs ... GiB'); now it is planned at the capped reserved peak, slower by the retries."""
    monkeypatch.setenv("TOOLKIT_CACHE_DIR", str(tmp_path / "cache"))
    tiny, strategy = resolve_model(str(tiny_llama_dir)), parse_strategy("fsdp2")
    job = Job(seq_len=128, micro_batch=2)
    hw = parse_hardware("1xA100-80GB")
    roomy = evaluate(tiny, hw, strategy, job, grid_of(strategy, hw))
    assert roomy.feasible and not any(n.startswith("allocator retries") for n in roomy.memory.notes)
    small = replace(hw, gpu=replace(hw.gpu, memory_bytes=roomy.memory.required_bytes - MiB // 4))
    c = evaluate(tiny, small, strategy, job, grid_of(strategy, small))
    assert c.feasible, c.reason
    assert c.memory.required_bytes == roomy.memory.required_bytes - 2 * MiB  # one 2 MiB segment fewer
    note = next(n for n in c.memory.notes if n.startswith("allocator retries "))
    assert note.startswith("allocator retries 2 a step: +")
    assert c.timing.retry_s == retry_cost()["free_malloc_s_per_call"] * 2 * 2  # 2 segments freed, taken again
    assert c.timing.step_time_s == roomy.timing.step_time_s + c.timing.retry_s
    assert "allocator retries avoided by micro-batch 1" in c.memory.notes  # expandable segments flush here too
    # A repeated plan (a new process: nothing kept in this one) reads the capped replay from disk and replays nothing
    from toolkit.estimate import reserved, retries

    monkeypatch.setattr(retries, "_RESULTS", {})
    monkeypatch.setattr(reserved, "_RESULTS", {})
    monkeypatch.setattr(reserved, "emit_step_events", None)  # a replay would fail: calling None
    again = evaluate(tiny, small, strategy, job, grid_of(strategy, small))
    assert (again.memory.required_bytes, again.memory.notes, again.timing) == (c.memory.required_bytes,
                                                                               c.memory.notes, c.timing)
