"""`--seq max`'s lever ladder (toolkit.estimate.levers): each long-context lever added in the order users pull
them, the tokens it buys, and the levers the job already has or the engines refuse, with why."""

import json
import math

import pytest

from toolkit.estimate.levers import CHUNKED, OFFLOAD, ROPE, SPLIT, TILED, lever_ladder
from toolkit.estimate.request import Request
from toolkit.inputs.hardware import parse_hardware
from toolkit.inputs.modelspec import resolve_model


@pytest.fixture(scope="module")
def qwen_ladder():
    """Qwen3-0.6B (40,960 positions) on ZeRO-2 over 2 x RTX 4090: memory stops the job as given at a few thousand
    tokens, the chunked loss reaches the positions, RoPE scaling lifts them."""
    spec = resolve_model("qwen3-0.6b")
    hw = parse_hardware("2xRTX-4090")
    return spec, lever_ladder(spec, hw, Request(seq_len=spec.max_positions, micro_batch=1), "zero2")


def test_the_levers_are_added_in_the_order_users_pull_them(qwen_ladder):
    _, rungs = qwen_ladder
    assert [r.lever for r in rungs] == ["your job", CHUNKED, ROPE, OFFLOAD, TILED, SPLIT]


def test_each_lever_pulled_reaches_at_least_the_rung_before(qwen_ladder):
    spec, rungs = qwen_ladder
    pulled = [r for r in rungs if r.found is not None]
    lengths = [r.seq_len for r in pulled]
    assert lengths == sorted(lengths) and lengths[0] > 0
    assert [r.gain for r in pulled[1:]] == [b - a for a, b in zip(lengths, lengths[1:])]
    # The job as given: memory stops it far below the positions; the chunked loss (no whole logits) reaches them.
    assert 4096 < lengths[0] < 16384
    chunked = rungs[1]
    assert chunked.seq_len == spec.max_positions == 40960 and chunked.found.capped_by_positions
    # RoPE scaling lifts the positions: memory stops it again, and the factor named is the one its length needs.
    rope = rungs[2]
    assert rope.seq_len > 40960 and not rope.found.capped_by_positions
    assert rope.rope_factor == math.ceil(rope.seq_len / 40960) and f"--rope-factor {rope.rope_factor}" in rope.flags
    # Offloading the checkpointed activations buys more again, with the peak back under the 24 GiB card.
    offload = rungs[3]
    assert offload.gain > 0 and offload.found.candidate.job.activation_offloading
    assert offload.found.candidate.memory.required_bytes <= parse_hardware("2xRTX-4090").gpu.memory_bytes


def test_tiling_is_pulled_with_the_offloading_before_it_as_alst_pairs_them(qwen_ladder):
    """Tiling takes the chunked loss's place (both replace the logits + loss) and keeps the offloading pulled before
    it, now DeepSpeed's checkpoint offload (toolkit.estimate.savers; TRL's was refused with tiling until 2026-12-05):
    205,184 tokens, 41,472 more than the offloading rung."""
    _, rungs = qwen_ladder
    offload, tiled = rungs[3], rungs[4]
    job = tiled.found.candidate.job
    assert job.tiled and job.activation_offloading and job.loss == "model" and not tiled.skipped
    assert tiled.gain == tiled.seq_len - offload.seq_len > 0
    assert tiled.found.candidate.memory.required_bytes <= parse_hardware("2xRTX-4090").gpu.memory_bytes


def test_the_sequence_split_is_added_to_the_tiled_offloading_job(qwen_ladder):
    """ZeRO-2 x Ulysses SP 2, tiled, with the checkpointed layers' inputs offloaded: each rank holds and offloads its
    half of the tokens, so the last rung buys more again."""
    _, rungs = qwen_ladder
    tiled, split = rungs[4], rungs[5]
    c = split.found.candidate
    assert c.job.activation_offloading and c.job.tiled and c.grid.sequence == 2
    assert split.flags == "--sequence-parallel 2"
    assert split.gain == split.seq_len - tiled.seq_len and split.seq_len > 1.5 * tiled.seq_len, \
        (split.seq_len, tiled.seq_len)
    assert c.memory.required_bytes <= parse_hardware("2xRTX-4090").gpu.memory_bytes
    assert split.rope_factor == math.ceil(split.seq_len / 40960)


def test_a_lever_the_job_already_has_or_the_model_lacks_is_not_pulled_and_says_why():
    spec = resolve_model("gpt2")
    rungs = lever_ladder(spec, parse_hardware("1xRTX-4090"),
                         Request(seq_len=1024, micro_batch=1, liger=False, loss="trl"), "ddp")
    by = {r.lever: r for r in rungs}
    assert by[CHUNKED].skipped == "already in the job (--loss trl)"
    assert by[ROPE].skipped == "gpt2 has no rotary position embedding to scale"
    assert by[SPLIT].skipped == "one GPU: no ranks to split the sequence over"
    # GPT-2's 1,024 positions stop every rung pulled.
    assert all(r.seq_len == 1024 for r in rungs if r.found is not None)


def test_plan_seq_max_json_and_plan_md_carry_the_ladder(tmp_path, capsys):
    from toolkit.cli import main

    out = tmp_path / "p"
    assert main(["plan", "qwen3-0.6b", "--gpus", "2xRTX-4090", "--seq", "max", "--strategies", "zero2", "--json",
                 "--out", str(out)]) == 0
    levers = json.loads(capsys.readouterr().out)["levers"]
    assert levers["strategy"] == "zero2"
    rows = levers["rungs"]
    assert [r["lever"] for r in rows] == ["your job", CHUNKED, ROPE, OFFLOAD, TILED, SPLIT]
    assert set(rows[0]) == {"lever", "flags", "pulled", "skipped", "row", "longest_seq", "gain", "rope_factor",
                            "required_bytes", "reason"}
    assert rows[1]["longest_seq"] == 40960 and rows[1]["gain"] == 40960 - rows[0]["longest_seq"]
    assert rows[4]["pulled"] is True and rows[4]["gain"] > 0  # tiled, with DeepSpeed's checkpoint offload
    assert rows[5]["pulled"] is True and rows[5]["gain"] > 0
    md = (out / "PLAN.md").read_text()
    assert "## Long-context levers" in md and f"| {CHUNKED} | 40,960 | {rows[1]['gain']:+,} |" in md
    svg = (out / "memory_vs_seq_levers.svg").read_text()
    assert svg.count("<polyline") == sum(r["pulled"] for r in rows)


def test_rope_scaling_stops_at_the_ladders_ceiling_where_memory_never_does(tiny_llama_dir):
    """A 256-position tiny Llama on an H100: memory never stops it, so RoPE is scaled to x64 (16,384 positions) and
    no further, and the table says that ceiling stopped it."""
    from toolkit.estimate.levers import MAX_ROPE_FACTOR, ladder_table

    spec = resolve_model(str(tiny_llama_dir))
    rungs = lever_ladder(spec, parse_hardware("1xH100-80GB"), Request(seq_len=256, micro_batch=1), "ddp")
    rope = next(r for r in rungs if r.lever == ROPE)
    assert rungs[1].seq_len == 256 and rungs[1].found.capped_by_positions
    assert rope.seq_len == 256 * MAX_ROPE_FACTOR == 16384 and rope.rope_factor == 64 and rope.gain == 16384 - 256
    assert f"RoPE x{MAX_ROPE_FACTOR}, the ladder's ceiling, stops it" in ladder_table(rungs)


def test_estimate_seq_max_climbs_plans_ladder_for_its_one_strategy(capsys):
    """estimate --seq max prints plan --seq max's ladder for its strategy (one lever_ladder, one table): the same
    rungs as plan --strategies NAME with the same flags (here checkpointing off, estimate's default), the first rung
    at estimate's own longest length. Qwen3-0.6B zero2 on 2 x RTX 4090 (with the peak band of 8eceaff): 3,072
    tokens as given; the chunked loss 5,248 (short of the positions: RoPE buys nothing yet); offloading 122,368;
    Ulysses SP 2 on top 223,616."""
    from toolkit.cli import main

    job = ["qwen3-0.6b", "--gpus", "2xRTX-4090", "--seq", "max", "--json"]
    assert main(["estimate", *job, "--strategy", "zero2"]) == 0
    estimated = json.loads(capsys.readouterr().out)
    assert main(["plan", *job, "--strategies", "zero2", "--checkpointing", "off"]) == 0
    planned = json.loads(capsys.readouterr().out)["levers"]
    assert estimated["levers"] == planned
    rungs = {r["lever"]: r["longest_seq"] for r in planned["rungs"]}
    assert estimated["longest_seq"] == rungs["your job"] > 2048
    assert rungs[ROPE] == rungs[CHUNKED] > rungs["your job"] and rungs[TILED] == 0
    # without checkpointing DeepSpeed's checkpoint offload moves nothing: tiling would reach less than TRL's offload
    tiled = next(r for r in planned["rungs"] if r["lever"] == TILED)
    assert tiled["skipped"].startswith("reaches ") and "nothing without checkpointing" in tiled["skipped"], tiled
    assert rungs[OFFLOAD] > 10 * rungs[CHUNKED] and rungs[SPLIT] > 1.5 * rungs[OFFLOAD]
    assert main(["estimate", *job[:-1], "--strategy", "zero2"]) == 0
    text = capsys.readouterr().out
    split = next(r for r in planned["rungs"] if r["lever"] == SPLIT)
    line = next(x for x in text.splitlines() if x.startswith(SPLIT))
    assert "levers on zero2" in text and line.split()[4:6] == [f"{split['longest_seq']:,}", f"{split['gain']:+,}"]


def test_the_planner_offloads_on_sequence_ranks_only_where_no_degree_fits_without_it(capsys):
    """plan's own saver search (auto_savers) tries activation offloading on a ZeRO x SP row last: Qwen3-0.6B at
    262,144 tokens (YaRN x7, TRL's chunked loss) on 2 x RTX 4090 fits no zero2 row plainly (sp 1 needs 43.5 GiB),
    so zero2 x sp 2 with offloading is planned (18.6 GiB); at 32,768 tokens sp 2 fits without it and the row stays
    as it was. (At 196,608 tokens zero2 x sp 2 fits without offloading since b44697d narrowed the peak band.)"""
    from toolkit.cli import main

    job = ["qwen3-0.6b", "--gpus", "2xRTX-4090", "--strategies", "zero2", "--micro-batch", "1", "--loss", "trl",
           "--json"]
    assert main(["plan", *job, "--seq", "262144", "--rope-scaling", "yarn", "--rope-factor", "7"]) == 0
    fits = [c for c in json.loads(capsys.readouterr().out)["candidates"] if c["feasible"]]
    assert [(c["name"], c["sequence_parallel"], c["activation_offloading"]) for c in fits] == \
        [("zero2 (dp=1 x sp=2) +act-offload", 2, True)]
    assert fits[0]["peak_bytes"] < fits[0]["capacity_bytes"]
    assert main(["plan", *job, "--seq", "32768"]) == 0
    rows = {c["name"]: c for c in json.loads(capsys.readouterr().out)["candidates"]}
    assert not any(c["activation_offloading"] for c in rows.values()), sorted(rows)
