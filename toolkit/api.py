"""toolkit from Python: estimate one strategy, plan over all of them, load a plan.json, emit a plan folder.

The same work the commands do, returning typed results instead of printing them; a notebook or a benchmark uses
these, never a hand-built Job:

    import toolkit.api as tk

    e = tk.estimate("llama-3-8b", "8xH100-80GB", strategy="zero3", seq_len=8192, micro_batch=2)
    e.fits, e.required_gib, e.tokens_per_s          # does it fit, GiB per GPU at the peak, predicted speed
    p = tk.plan("llama-3-8b", "8xH100-80GB", seq_len=4096, global_batch=256)
    p.chosen.name, [c.name for c in p.feasible][:3]
    tk.emit(p.to_plan(), "plans/8b")                # the plan folder, as `toolkit plan --out` writes it
    tk.load_plan("plans/8b/plan.json").strategy

A model is a catalog name, a local folder or config.json, a hub id, or a ModelSpec; hardware is a spec string
(`8xH100-80GB`, `2x8xA100-80GB`) or a Hardware. The job's settings are the fields of toolkit.inputs.job.Job
(estimate) and toolkit.estimate.request.Request (plan), spelled as those classes spell them; bad input raises
toolkit.errors.UserError with the one line the command line would print.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toolkit.errors import UserError
from toolkit.inputs.choices import GIB

if TYPE_CHECKING:
    from toolkit.estimate.memory import Breakdown
    from toolkit.estimate.candidate import Candidate
    from toolkit.estimate.duration import Duration
    from toolkit.estimate.request import Request
    from toolkit.estimate.timing import Timing
    from toolkit.inputs.grid import ParallelGrid
    from toolkit.inputs.hardware import Hardware
    from toolkit.inputs.job import Job
    from toolkit.inputs.modelspec import ModelSpec
    from toolkit.plan.schema import Plan


__all__ = ["Estimate", "PlanResult", "emit", "estimate", "load_plan", "model", "hardware", "plan"]


def model(name: "str | ModelSpec | None" = None, *, trust_remote_code: bool = False, **numbers: int) -> "ModelSpec":
    """The ModelSpec of a catalog name, local folder / config.json or hub id, or of bare numbers
    (`params=7e9`, or `layers= hidden= heads= kv_heads= ffn= vocab=`), as the commands resolve it."""
    from toolkit.inputs.modelspec import ModelSpec, resolve_model

    if isinstance(name, ModelSpec):
        return name
    return resolve_model(name, trust_remote_code=trust_remote_code,
                         **{k: (int(v) if v is not None else None) for k, v in numbers.items()})


def hardware(gpus: "str | Hardware", **options: Any) -> "Hardware":
    """The Hardware of `8xH100-80GB` / `2x8xA100-80GB`; options: nodes, inter_node_gbps, cpu_ram_gib,
    power_limit_w (as the flags of the same names)."""
    from toolkit.inputs.hardware import Hardware, parse_hardware

    if isinstance(gpus, Hardware):
        if options:
            raise UserError(f"hardware options {sorted(options)} apply to a spec string, not a built Hardware")
        return gpus
    return parse_hardware(gpus, **options)


def _hardware_options(options: dict[str, Any]) -> dict[str, Any]:
    names = ("nodes", "inter_node_gbps", "cpu_ram_gib", "power_limit_w")
    return {name: options.pop(name) for name in names if name in options}


def _seq_len(spec: "ModelSpec", seq_len: int | None) -> int:
    from toolkit.inputs.job import check_seq_len, default_seq_len

    seq_len, _ = default_seq_len(spec, seq_len)
    check_seq_len(spec, seq_len)
    return seq_len


def _objective(method: str | None, options: dict[str, Any]) -> None:
    """method="dpo" / "dpo+lora": a DPO job with TRL's defaults unless `dpo=Dpo(...)` is given; "grpo" likewise
    (`grpo=Grpo(...)`)."""
    from toolkit.inputs.choices import split_method
    from toolkit.inputs.grpo import Grpo
    from toolkit.inputs.preference import Dpo

    objective = split_method(method)[0] if method else None
    if objective == "dpo" and options.get("dpo") is None:
        options["dpo"] = Dpo()
    if objective == "grpo" and options.get("grpo") is None:
        options["grpo"] = Grpo()


def _allocator(options: dict[str, Any], hw: "Hardware") -> None:
    """The allocator setting the commands give the job (toolkit.inputs.allocconf: the environment's
    PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF, else the plan's default), unless the caller names one."""
    import os

    from toolkit.inputs.allocconf import alloc_conf

    if "allocator_conf" not in options:
        options["allocator_conf"] = alloc_conf(options.get("device_kind", "cuda"), options.get("grpo"), hw.gpu,
                                               os.environ).conf


def _adapter(method: str | None, adapter: Any):
    from toolkit.inputs.choices import split_method
    from toolkit.inputs.lora import FULL, Adapter, adapter_from_flags

    method = split_method(method)[1] if method else None

    if adapter is not None and method is not None and adapter.method != method:
        raise UserError(f"method={method!r} and adapter of method {adapter.method!r}: give one of them")
    if adapter is not None:
        if not isinstance(adapter, Adapter):
            raise UserError(f"adapter must be a toolkit.inputs.lora.Adapter, got {type(adapter).__name__}")
        return adapter
    return adapter_from_flags(method) if method else FULL


@dataclass(frozen=True)
class Estimate:
    """One strategy's estimate: per-GPU memory (`memory`, every term), the step time (`timing`), and what it
    was computed for."""

    model: "ModelSpec"
    hardware: "Hardware"
    job: "Job"
    grid: "ParallelGrid"
    candidate: "Candidate"
    model_name: str | None = None
    """The model as given (a name, folder or hub id; None for a ModelSpec): its tokenizer counts `data=`."""

    @property
    def strategy(self) -> str:
        return self.candidate.strategy.name

    @property
    def memory(self) -> "Breakdown":
        return self.candidate.memory

    @property
    def timing(self) -> "Timing":
        return self.candidate.timing

    @property
    def fits(self) -> bool:
        return self.memory.fits

    @property
    def required_gib(self) -> float:
        """What the job needs on each GPU at its peak phase (tensors, context, allocator margin), GiB."""
        return self.memory.required_bytes / GIB

    @property
    def step_s(self) -> float:
        return self.timing.step_s

    @property
    def tokens_per_s(self) -> float:
        return self.timing.tokens_per_s

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model.summary(), "hardware": self.hardware.spec, "strategy": self.strategy,
                "per_gpu": self.memory.to_dict(), "fits": self.fits, "timing": self.timing.to_dict()}

    def time_to_train(self, dataset_tokens: float | None = None, *, data: str | Path | None = None,
                      tokenizer: Any = None, epochs: float = 1.0, gpu_hour_price: float | None = None) -> "Duration":
        """Steps, hours, GPU-hours and cost of training on `dataset_tokens`, or on the tokens of local `data` counted
        with `tokenizer` (by default the model's own), as `estimate --dataset-tokens / --data` print them."""
        from toolkit.estimate.duration import duration

        run = _run_size(dataset_tokens, epochs, gpu_hour_price, data=data, tokenizer=tokenizer,
                        model_name=self.model_name, seq_len=self.job.seq_len)
        return duration(run, self.candidate, self.hardware.world_size)


def _run_size(dataset_tokens: float | None, epochs: float, gpu_hour_price: float | None, *,
              data: str | Path | None = None, tokenizer: Any = None, model_name: str | None = None,
              seq_len: int = 0):
    """The run's size from a token count or from local data (counted as `--data` counts it), checked as the
    flags are."""
    from toolkit import bounds
    from toolkit.estimate.duration import RunSize

    if (dataset_tokens is None) == (data is None):
        raise UserError("time_to_train needs dataset_tokens or data (what the run trains on), not both or neither")
    bounds.check_number("epochs", epochs, bounds.EPOCHS)
    if gpu_hour_price is not None:
        bounds.check_number("gpu_hour_price", gpu_hour_price, bounds.GPU_HOUR_PRICE)
    if data is not None:
        from toolkit.run.data_tokens import run_size_from_data

        if tokenizer is None and model_name is None:
            raise UserError("data= counts tokens with the model's tokenizer, and a model given as a ModelSpec names "
                            "none; pass tokenizer= (a tokenizer, or the model's name or folder) or dataset_tokens=")
        if isinstance(tokenizer, (str, Path)):
            model_name, tokenizer = str(tokenizer), None
        return run_size_from_data(str(data), model_name, seq_len=seq_len, epochs=float(epochs),
                                  gpu_hour_price=gpu_hour_price, tokenizer=tokenizer)
    bounds.check_number("dataset_tokens", dataset_tokens, bounds.DATASET_TOKENS)
    return RunSize(dataset_tokens=int(dataset_tokens), epochs=float(epochs), gpu_hour_price=gpu_hour_price)


def estimate(model_name: "str | ModelSpec", gpus: "str | Hardware" = "8xH100-80GB", *, strategy: str = "zero3",
             seq_len: int | None = None, micro_batch: int = 1, grad_accum: int = 1,
             pipeline_stages: int | None = None, tensor_parallel: int = 1, context_parallel: int = 1,
             sequence_parallel: int = 1, method: str | None = None, adapter: Any = None,
             **job_and_hardware: Any) -> Estimate:
    """Memory and step time of one strategy (`toolkit estimate`). Keyword arguments beyond these are Job fields
    (precision, optimizer, checkpointing, attention, liger, tiled, compile, ...) or hardware options (nodes,
    inter_node_gbps, cpu_ram_gib, power_limit_w)."""
    from toolkit.estimate.search import evaluate
    from toolkit.inputs.grid import ParallelGrid
    from toolkit.inputs.job import Job, check_job
    from toolkit.inputs.strategy import parse_strategy

    options = dict(job_and_hardware)
    hw = hardware(gpus, **_hardware_options(options))
    spec = model(model_name)
    chosen = parse_strategy(strategy)
    _objective(method, options)
    _allocator(options, hw)
    job = _job(Job, spec, seq_len=seq_len, micro_batch=micro_batch, grad_accum=grad_accum,
               adapter=_adapter(method, adapter), **options)
    grid = ParallelGrid.for_strategy(chosen, nodes=hw.nodes, gpus_per_node=hw.gpus_per_node,
                                     pipeline_stages=pipeline_stages, tensor=tensor_parallel,
                                     context=context_parallel, sequence=sequence_parallel)
    check_job(spec, job, hw, chosen, pipeline_stages=grid.pipeline_stages)
    grid.check_model(spec)
    grid.check_sequence(job.seq_len, spec.effective_attention(job.attention), spec)
    return Estimate(spec, hw, job, grid, evaluate(spec, hw, chosen, job, grid, prune=False),
                    model_name if isinstance(model_name, str) else None)


def _job(cls, spec: "ModelSpec", *, seq_len: int | None, **fields: Any):
    """A Job or Request from keyword arguments spelled as the class spells its fields; a name it lacks is one
    line naming the fields it has."""
    import dataclasses

    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise UserError(f"unknown setting {unknown[0]!r} for {cls.__name__}: one of {', '.join(sorted(known))}")
    if fields.get("checkpointing") in ("on", "off"):  # the CLI's words; plan's "auto" stays a word
        fields["checkpointing"] = fields["checkpointing"] == "on"
    if fields.get("grpo") is not None and seq_len is None:  # GRPO trains prompt + completion
        seq_len = fields["grpo"].seq_len
    return cls(seq_len=_seq_len(spec, seq_len), **fields)


@dataclass(frozen=True)
class PlanResult:
    """Every candidate the planner tried, best first (the feasible ones ranked, then each refusal with its
    reason), and the one it chose."""

    model: "ModelSpec"
    hardware: "Hardware"
    request: "Request"
    candidates: "list[Candidate]"
    model_name: str

    @property
    def feasible(self) -> "list[Candidate]":
        return [c for c in self.candidates if c.feasible]

    @property
    def refused(self) -> "list[Candidate]":
        return [c for c in self.candidates if not c.feasible]

    @property
    def chosen(self) -> "Candidate | None":
        return self.feasible[0] if self.feasible else None

    def candidate(self, name: str) -> "Candidate":
        """A row by the name the table prints (`zero3`, `zero2 (dp=4 x sp=2)`), as `plan --choose` takes it; a row
        that cannot run is refused with its reason."""
        from toolkit.estimate.search import candidate_named

        return candidate_named(name, self.candidates, flag="candidate")

    def rows(self) -> list[dict[str, Any]]:
        """The table as plain dicts (what `toolkit plan --json` prints as candidates)."""
        return [c.row() for c in self.candidates]

    def time_to_train(self, dataset_tokens: float | None = None, *, data: str | Path | None = None,
                      tokenizer: Any = None, candidate: "Candidate | str | None" = None, epochs: float = 1.0,
                      gpu_hour_price: float | None = None) -> "Duration":
        """Steps, hours, GPU-hours and cost of training on `dataset_tokens` (or on local `data`, counted with
        `tokenizer`, by default the model's own) with the chosen candidate (or another one), as
        `plan --dataset-tokens / --data` print for #1."""
        from toolkit.estimate.duration import duration

        chosen = self.candidate(candidate) if isinstance(candidate, str) else candidate or self.chosen
        if chosen is None or not chosen.feasible:
            raise UserError("no strategy fits: there is no run to time (see .refused for each reason)")
        run = _run_size(dataset_tokens, epochs, gpu_hour_price, data=data, tokenizer=tokenizer,
                        model_name=self.model_name, seq_len=chosen.job.seq_len)
        return duration(run, chosen, self.hardware.world_size)

    def to_plan(self, candidate: "Candidate | str | None" = None) -> "Plan":
        """The Plan (plan.json) of the chosen candidate, or of another one."""
        from toolkit.estimate.search import to_plan

        chosen = self.candidate(candidate) if isinstance(candidate, str) else candidate or self.chosen
        if chosen is None:
            raise UserError("no strategy fits: there is no plan to write (see .refused for each reason)")
        if not chosen.feasible:  # a Candidate object passed in
            raise UserError(f"{chosen.name} cannot run: {chosen.reason}")
        return to_plan(chosen, self.model, self.hardware, self.model_name)


def plan(model_name: "str | ModelSpec", gpus: "str | Hardware" = "8xH100-80GB", *, seq_len: int | None = None,
         global_batch: int | None = None, micro_batch: int | None = None, method: str | None = None,
         adapter: Any = None, **request_and_hardware: Any) -> PlanResult:
    """Every strategy ranked (`toolkit plan`). Keyword arguments beyond these are Request fields (strategies,
    precision, optimizer, checkpointing, tensor_parallel, tiled, ...) or hardware options."""
    from toolkit.estimate.request import Request
    from toolkit.estimate.search import plan_candidates
    from toolkit.inputs.job import job_problem
    from toolkit.inputs.resolve import recorded_model

    options = dict(request_and_hardware)
    hw = hardware(gpus, **_hardware_options(options))
    spec = model(model_name)
    if isinstance(options.get("strategies"), str):
        options["strategies"] = tuple(s.strip() for s in options["strategies"].split(","))
    if options.get("strategies"):
        from toolkit.inputs.strategy import parse_strategy

        options["strategies"] = tuple(parse_strategy(s).name for s in options["strategies"])
    unfit = job_problem(options.get("precision", "bf16"), hw.gpu) or spec.attention_problem(options.get("attention"))
    if unfit:
        raise UserError(unfit)
    _objective(method, options)
    _allocator(options, hw)
    req = _job(Request, spec, seq_len=seq_len, global_batch=global_batch, micro_batch=micro_batch,
               adapter=_adapter(method, adapter), **options)
    name = model_name if isinstance(model_name, str) else spec.name
    return PlanResult(spec, hw, req, plan_candidates(spec, hw, req), recorded_model(name) or spec.name)


def load_plan(path: str | Path) -> "Plan":
    """A plan.json (or a plan folder holding one), validated as `toolkit launch` and `toolkit emit` load it."""
    from toolkit.plan.files import PLAN_JSON
    from toolkit.plan.schema import load_plan as load

    path = Path(path)
    return load(path / PLAN_JSON if path.is_dir() else path)


def emit(plan: "Plan | PlanResult", out: str | Path, *, force: bool = False, nvme_path: str | None = None,
         hosts: list[str] | None = None) -> list[Path]:
    """Write the plan folder (`toolkit plan --out` / `toolkit emit`): staged and swapped in whole, never over an
    existing folder without `force`. A PlanResult writes its chosen plan with the table in PLAN.md."""
    from toolkit.emit import emit_files

    candidates = None
    if isinstance(plan, PlanResult):
        candidates, plan = plan.rows(), plan.to_plan()
    return emit_files(plan, Path(out), force=force, candidates=candidates, nvme_path=nvme_path, hosts=hosts)
