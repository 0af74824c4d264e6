"""The dtype DeepSpeed reduces gradients in under Ulysses sequence parallelism, read from the installed engine.

When its sequence-parallel world is above one, DeepSpeed's engine replaces its communication_data_type with the
config's `seq_parallel_communication_data_type` (runtime/engine.py `_configure_distributed_model`), whose default is
runtime/constants.py's SEQ_PARALLEL_COMMUNICATION_DATA_TYPE_DEFAULT. ZeRO-3 is built with that dtype after it: its IPG
reduce bucket is `torch.empty(reduce_bucket_size, dtype=...)` per communication dtype (stage3.py `__init__`), each
gradient is copied into it (`__add_grad_to_ipg_bucket`), and a bucket is reduce-scattered in it and cast back to the
gradient partitions' dtype (`__avg_scatter_grads`). The constants module sets None (the model's dtype) where NCCL is
2.27.3 or newer and "fp32" elsewhere, then sets "fp32" again on the next line, unconditionally (DeepSpeed d3b9cb8c4,
#7364, June 2025; so in 0.18.1 to 0.19.8): every run reduces in fp32 unless its config names the key. toolkit's
DeepSpeed JSON leaves it out, and an accelerate YAML's inline deepspeed_config drops it (docs/ENGINE_FACTS.md).

Read with ast, not imported: importing the module asks the accelerator for NCCL's version.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

from toolkit.inputs.choices import compute_bytes

DEFAULT_NAME = "SEQ_PARALLEL_COMMUNICATION_DATA_TYPE_DEFAULT"
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""DeepSpeed's names for a communication dtype (runtime/config.py get_communication_data_type) -> bytes."""


@functools.cache
def sp_default_dtype() -> str | None:
    """The installed DeepSpeed's default `seq_parallel_communication_data_type`: the value of the module's last
    top-level assignment (an assignment inside an if takes its first branch's, CUDA with a recent NCCL); None: the
    model's dtype. "fp32" where the module is not found (DeepSpeed's documented default)."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return "fp32"
    path = Path(next(iter(spec.submodule_search_locations))) / "runtime" / "constants.py"
    try:
        module = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return "fp32"
    value: object = "fp32"
    for node in module.body:
        statements = node.body if isinstance(node, ast.If) else [node]
        for statement in statements:
            if isinstance(statement, ast.Assign) and [getattr(t, "id", None) for t in statement.targets] == [
                    DEFAULT_NAME]:
                try:
                    value = ast.literal_eval(statement.value)
                except ValueError:
                    return "fp32"
    return value if value is None or value in DTYPE_BYTES else "fp32"


def sp_reduce_bytes(precision: str) -> int:
    """Bytes of an element DeepSpeed reduces gradients in under Ulysses SP, with the config leaving
    `seq_parallel_communication_data_type` out (toolkit's JSON, an accelerate YAML)."""
    dtype = sp_default_dtype()
    return compute_bytes(precision) if dtype is None else DTYPE_BYTES[dtype]


def zero_reduce_bytes(precision: str, sequence: int) -> int:
    """Bytes of an element ZeRO's gradient reduction runs in at a sequence-parallel degree: the SP default above
    1, the gradients' own (the model's dtype: runtime/engine.py `communication_data_type`) otherwise."""
    return sp_reduce_bytes(precision) if sequence > 1 else compute_bytes(precision)
