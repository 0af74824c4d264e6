"""How benchmarks/published.py reads a published row's job: what it scores and what it lists (issue 28)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import published  # noqa: E402  (benchmarks/ is not a package)


def _row(row_id: str) -> dict:
    return next(r for r in published.load_rows() if r["id"] == row_id)


def test_a_reading_made_on_another_model_is_listed_with_its_reason_not_scored():
    """ms-swift's image examples kept the header Qwen2-VL-7B gave them when their model line moved to Qwen2.5-VL:
    the row names the reading's model, and published.py lists it with the reason instead of scoring it."""
    row = _row("SWIFTEX-Qwen2.5-VL-7B-1xGPU-LoRA-caption")
    assert row["job"]["reading_model"] == "qwen2-vl-7b-instruct" != row["job"]["model"]
    assert published.unmodelled(row["job"]) == ["reading_of_another_model"]
    same = dict(row["job"], reading_model=row["job"]["model"])  # a reading of the named model itself is scored
    assert published.unmodelled(same) == []


def test_a_rows_base_dtype_reaches_the_adapter_the_estimate_takes():
    """The FSDP2 row's base was upcast to fp32 by the accelerate of its time: its lora object says so, and the
    Adapter the estimate is given carries it; a row without one keeps the compute dtype (auto)."""
    fsdp2 = _row("SWIFTEX-Qwen2.5-7B-2xGPU-LoRA-FSDP2")
    spec = published._spec(fsdp2["job"]["model"])
    assert published.adapter_of(fsdp2["job"], spec, fsdp2["framework"]).base_dtype == "fp32"
    zero2 = _row("SWIFTEX-Qwen2.5-7B-2xGPU-LoRA-ZeRO2")
    assert published.adapter_of(zero2["job"], spec, zero2["framework"]).base_dtype == "auto"


def test_a_ddp_row_run_on_a_torch_that_recorded_nccls_stream_is_listed_not_scored():
    """ms-swift's DDP header dates from torch 2.5, whose NCCL broadcasts recorded their stream on DDP's setup
    buckets: listed with the reason. The same job on the installed torch's side of the change, on one GPU (no
    broadcast), or under DeepSpeed (synchronous broadcasts) is scored."""
    ddp = _row("SWIFTEX-Qwen2.5-7B-2xGPU-LoRA-DDP")
    assert ddp["job"]["torch"] == "2.5"
    assert published.unmodelled(ddp["job"], ddp["num_gpus"]) == ["nccl_record_stream"]
    assert published.unmodelled(dict(ddp["job"], torch="2.8"), ddp["num_gpus"]) == []
    assert published.unmodelled(ddp["job"], 1) == []
    for row_id in ("SWIFTEX-Qwen2.5-7B-2xGPU-LoRA-ZeRO2", "SWIFTEX-Qwen2.5-7B-2xGPU-LoRA-ZeRO3",
                   "SWIFTEX-Qwen2.5-7B-1xGPU-LoRA"):
        row = _row(row_id)
        assert row["job"]["torch"] == "2.5"
        assert published.unmodelled(row["job"], row["num_gpus"]) == []


def _ddp_setup_broadcast(buckets: int, recorded: bool) -> int:
    """DDP's _sync_module_states through the allocator model: weights of `buckets` x 250 MiB, then c10d's
    broadcast_coalesced (a flat copy of each 250 MiB bucket, two in flight, the oldest finished and freed before the
    next is made), its NCCL work on stream 1 never seen complete, as when the host runs ahead of the GPU. Returns the
    reserved peak above the weights."""
    from toolkit.estimate.allocator import CachingAllocator

    bucket = 250 * 2**20  # DDP's broadcast_bucket_size (torch nn/parallel/distributed.py)
    allocator = CachingAllocator()
    for _ in range(buckets):
        allocator.malloc(bucket)
    weights = allocator.stats.reserved
    in_flight = []
    for _ in range(buckets):
        if len(in_flight) == 2:
            allocator.free(in_flight.pop(0))
        flat = allocator.malloc(bucket)
        if recorded:  # ProcessGroupNCCL before torch 2.8: recordStream(input, ncclStream)
            allocator.record_stream(flat, 1)
        in_flight.append(flat)
    for flat in in_flight:
        allocator.free(flat)
    return allocator.stats.peak_reserved - weights


def test_recorded_nccl_buckets_hold_up_to_the_whole_model_and_stashed_ones_two_buckets():
    """The bound the published prose gives the DDP row: with the stream recorded and the broadcasts not yet done,
    every bucket stays cached (the model's weights again); freed after their wait, as the installed torch does, the
    allocator reuses them and two buckets are the most held."""
    assert _ddp_setup_broadcast(8, recorded=True) == 8 * 250 * 2**20
    assert _ddp_setup_broadcast(8, recorded=False) == 2 * 250 * 2**20


def test_the_image_rows_written_for_qwen25_vl_itself_are_scored_and_the_packed_rows_probes_keep_its_length():
    """ms-swift's grounding notebook, predict_with_generate and packing examples were written for Qwen2.5-VL-7B
    (no reading of another model): scored. The packed row's make-up is unknown, so it is probed at smaller and
    larger images; each probe, and the make-up scored, fills the same 8,192-token row (the processor's own tokens
    per image)."""
    from toolkit.inputs.images import image_job

    for suffix in ("grounding", "predict-with-generate", "packing-ZeRO2"):
        row = _row(f"SWIFTEX-Qwen2.5-VL-7B-{'4' if 'packing' in suffix else '1'}xGPU-LoRA-{suffix}")
        assert "reading_model" not in row["job"] and published.unmodelled(row["job"], row["num_gpus"]) == []
    packed = _row("SWIFTEX-Qwen2.5-VL-7B-4xGPU-LoRA-packing-ZeRO2")
    spec = published._spec(packed["job"]["model"])
    images = packed["job"]["images"]
    for probe in (*published.IMAGE_PROBES[packed["id"]], {}):
        seq, fields = image_job(spec, probe.get("per_sample", images["per_sample"]), probe.get("size", images["size"]),
                                probe.get("text", packed["seq_len"]))
        assert seq == 8192, (probe, fields)


def test_torchtunes_rows_train_bf16_adapters_and_its_nf4_qlora_is_listed_not_scored():
    """torchtune builds its LoRALinear under the recipe's bf16 default dtype: its rows' adapters are estimated in
    the base's dtype, as LitGPT's are, where a PEFT row keeps PEFT's fp32 adapters. Its QLoRA quantises with
    torchao's NF4, not bitsandbytes': listed with that reason; the same job with bitsandbytes would be scored."""
    lora = _row("TUDOC-Llama-2-7B-1xGPU-LoRA-qv-r8")
    spec = published._spec(lora["job"]["model"])
    assert published.adapter_of(lora["job"], spec, lora["framework"]).adapter_dtype == "base"
    peft = _row("PEFT-MMQA-3B-L40S-LoRA-r32-qv")
    peft_spec = published._spec(peft["job"]["model"])
    assert published.adapter_of(peft["job"], peft_spec, peft["framework"]).adapter_dtype == "auto"
    qlora = _row("TUDOC-Llama-2-7B-1xGPU-QLoRA-r8")
    assert published.unmodelled(qlora["job"]) == ["torchao_nf4"]
    assert published.unmodelled({k: v for k, v in qlora["job"].items() if k != "quantizer"}) == []
    assert published.source_of(qlora["id"], published.load_splits()) == "TUDOC"
    assert published.load_splits()["TUDOC"] == published.load_splits()["TRLSFT"] == "held-out"
