"""The tracer's recording instruments: a TorchDispatchMode that logs every storage an op creates and, through a
weakref on the storage, when it dies (replaying the log gives live bytes at any moment), the per-region tallies of
saved tensors, and the peaks read off the live-bytes curve between region marks."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from toolkit.estimate.activations import RegionTrace

class StorageLog:
    """Every storage created by an op, as (serial, +bytes) on birth and (serial, -bytes) on death."""

    def __init__(self) -> None:
        self.events: list[tuple[int, int]] = []
        self.marks: dict[str, int] = {}
        self.alive: dict[int, tuple[int, Any]] = {}  # id(storage) -> (serial, weakref)
        self._next_serial = 0
        self.ops = 0
        """ATen operations dispatched so far (views, detaches and in-place ops included: each costs the host its
        dispatch, toolkit.estimate.hosttime)."""
        self.op_marks: dict[str, int] = {}

    def mark(self, label: str) -> None:
        self.marks.setdefault(label, len(self.events))
        self.op_marks.setdefault(label, self.ops)

    def ops_between(self, start: str, end: str) -> int:
        """Operations dispatched between two marks (0 where either is missing)."""
        if start not in self.op_marks or end not in self.op_marks:
            return 0
        return max(0, self.op_marks[end] - self.op_marks[start])

    def serial_of(self, storage) -> int | None:
        entry = self.alive.get(id(storage))
        return entry[0] if entry is not None else None

    def note(self, storage) -> None:
        key = id(storage)
        if key in self.alive:
            return
        serial, nbytes = self._next_serial, storage.nbytes()
        self._next_serial += 1

        def died(_ref, log=self, key=key, serial=serial, nbytes=nbytes):
            log.events.append((serial, -nbytes))
            log.alive.pop(key, None)

        self.alive[key] = (serial, weakref.ref(storage, died))
        self.events.append((serial, nbytes))

    def live_curve(self, excluded: set[int]) -> list[int]:
        """curve[k] = live bytes after the first k events."""
        return [0, *accumulate(0 if s in excluded else d for s, d in self.events)]


TOKEN_LOOP_OPS_PER_TOKEN = 24
"""More operations than this per token in one decoder layer's forward (and more than TOKEN_LOOP_MIN_OPS) is a Python
loop over the tokens. Measured in fake-tensor traces at 1,024 tokens: chunked scans run 1-3 a token (Qwen3-Next's and
OLMo-hybrid's gated delta rule), 6-12 (Bailing-hybrid); transformers' token-by-token reference scans (Jamba's and
Mamba's slow_forward, used where the mamba-ssm / causal-conv1d kernels are missing) about 47."""
TOKEN_LOOP_MIN_OPS = 10_000
"""Below this a layer's forward is never taken for a token loop (a Python loop over a couple of hundred experts)."""


def make_recorder(log: StorageLog, param_ids: set[int], autocast_copies: dict[int, tuple[str, int]],
                   region_now, seq_len: int | None = None):
    """Logs storages; notes casts of parameters (autocast weight copies) in autocast_copies: serial -> (region
    that made it, bytes). With `seq_len`, a decoder layer whose forward loops over the tokens is noted in
    `token_loop` as soon as it shows, and the tracer's layer hooks stop the trace there: tracing such a loop takes minutes a layer, and it is the reference
    path the model's GPU kernels replace, whose saved tensors differ."""
    import torch
    from torch import Tensor
    from torch.utils._python_dispatch import TorchDispatchMode

    to_copy = torch.ops.aten._to_copy.default

    loop_limit = max(TOKEN_LOOP_MIN_OPS, TOKEN_LOOP_OPS_PER_TOKEN * seq_len) if seq_len else None
    ops_in: dict[str, int] = {}

    class Recorder(TorchDispatchMode):
        grouped_mm = False  # MoE experts ran as grouped matmuls
        token_loop: str | None = None  # why a decoder layer looks like a Python loop over the tokens

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace != "prim":  # prim::device and the like: a fake tensor's metadata queries
                log.ops += 1
            if "grouped_mm" in func.__name__:
                self.grouped_mm = True
            if loop_limit is not None:
                region = region_now()
                if region.startswith("layer"):
                    ops_in[region] = count = ops_in.get(region, 0) + 1
                    if count > loop_limit and self.token_loop is None:  # raised by the tracer's layer hooks:
                        # raising here, inside an op a kernel wrapper runs (Mamba's hub-kernels scan), aborts torch
                        self.token_loop = (
                            f"its decoder layer ran more than {loop_limit:,} operations at {seq_len:,} "
                            f"tokens, a Python loop over the tokens (as transformers' reference path for Mamba-style "
                            "layers runs where the mamba-ssm / causal-conv1d CUDA kernels are missing); the GPU "
                            "kernels keep other tensors than that loop, so toolkit cannot trace this model's "
                            "activations")
            out = func(*args, **(kwargs or {}))
            inputs = {id(t.untyped_storage()) for t in _op_tensors((args, kwargs), Tensor)}
            for t in _op_tensors(out, Tensor):
                st = t.untyped_storage()
                if id(st) not in inputs:  # not a view or in-place result of something already known
                    log.note(st)
            if (func is to_copy and isinstance(args[0], torch.Tensor)
                    and id(args[0].untyped_storage()) in param_ids):
                st = out.untyped_storage()
                serial = log.serial_of(st)
                if serial is not None:
                    autocast_copies[serial] = (region_now(), st.nbytes())
            return out

    return Recorder()


def _op_tensors(obj, tensor_type) -> list:
    """The tensors in an ATen op's arguments or results, in the order torch's tree_leaves gives them: an op takes and
    returns only tensors, scalars and tuples / lists / dicts of them (named-tuple results are tuples). Walked by hand:
    tree_leaves' generic container lookup was a tenth of a trace's CPU (two calls per op, 79k ops in one Qwen3.5
    trace at 2,048 tokens)."""
    # A loop, not a recursive closure: a closure that calls itself is a reference cycle, which would hold the found
    # tensors until the garbage collector runs and move their deaths in the storage log.
    found, todo = [], [obj]
    while todo:
        x = todo.pop()
        if isinstance(x, tensor_type):
            found.append(x)
        elif isinstance(x, (tuple, list)):
            todo.extend(reversed(x))
        elif isinstance(x, dict):
            todo.extend(reversed(list(x.values())))
    return found


@dataclass
class Region:
    saved_bytes: int = 0
    forward_grad_bytes: int = 0
    autocast_copy_bytes: int = 0
    autocast_cache_bytes: int = 0
    offload_bytes: int = 0


@dataclass
class Run:
    embedding: RegionTrace
    layers: list[RegionTrace]
    head: RegionTrace
    output_bytes: int
    loss_bytes: int
    layer_kinds: tuple = field(default_factory=tuple)


def tensors_in(obj):
    import torch
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


def peak_above(curve: list[int], marks: dict[str, int], start: str, end: str, held: int) -> int:
    """Peak live bytes between two marks, above `held`."""
    if start not in marks or end not in marks or marks[end] < marks[start]:
        return 0
    return max(0, max(curve[marks[start]:marks[end] + 1]) - held)


def backward_peak(curve: list[int], grad_curve: list[int], marks: dict[str, int], start: str, end: str,
                   held: int) -> tuple[int, int, int]:
    """(peak live bytes above `held`, parameter-gradient bytes created by then, all created in the window) for a
    backward window; the peak is that of activations plus the gradients the window has created, since both are
    live together on the device."""
    if start not in marks or end not in marks or marks[end] < marks[start]:
        return 0, 0, 0
    a, b = marks[start], marks[end]
    base = grad_curve[a]
    k = max(range(a, b + 1), key=lambda i: curve[i] + grad_curve[i] - base)
    return max(0, curve[k] - held), max(0, grad_curve[k] - base), max(0, grad_curve[b] - base)
