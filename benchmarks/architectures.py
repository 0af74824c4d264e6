"""The architecture sweep: the DEFAULT config of every model type the installed transformers maps to a causal LM or
an image-text-to-text model, each written as transformers' save_pretrained writes it and estimated as `toolkit
estimate DIR --gpus 8xH100-80GB --strategy zero3 --seq 1024` does. Each type ends ok (its parameters and per-GPU
peak), refused in one line (the line), or in a traceback (a bug: no input may end so), or past its time limit.

    python benchmarks/architectures.py               # every type: writes benchmarks/results/architectures.{md,json}
    python benchmarks/architectures.py mamba bamba   # those types only, printed, no results written
    python benchmarks/architectures.py --resume      # keep the rows already written, sweep the rest (the type a
                                                     # dead process was on recorded as a crash)

Default configs are not always what real checkpoints look like (fields a real config fills are null in some): a
refusal naming such a field is the right answer for them. About 15 minutes on one quiet core.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

from provenance import measured_line, meta

LIMIT_S = int(os.environ.get("SWEEP_LIMIT_S", 600))  # per type; a recurrent model's reference scan (Mamba without mamba_ssm) is the slowest trace


class _TimeUp(Exception):
    pass


def model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

    return sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES))


def sweep_one(kind: str, folder: Path) -> dict:
    """One type's row: status ok / refused / traceback / no config / timeout, with its numbers or words."""
    from transformers import CONFIG_MAPPING

    from toolkit import api
    from toolkit.errors import UserError
    from toolkit.inputs.choices import GIB

    try:
        CONFIG_MAPPING[kind]().save_pretrained(folder)
    except Exception as exc:  # transformers' own default config does not build: nothing of ours to run
        return {"status": "no config", "line": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    start = time.time()
    signal.alarm(LIMIT_S)
    try:
        result = api.estimate(str(folder), "8xH100-80GB", strategy="zero3", seq_len=1024, micro_batch=1)
        row = {"status": "ok", "params": result.model.params, "peak_gib": round(result.required_gib, 2),
               "activations_gib": round(result.memory.activations_bytes / GIB, 3)}
    except _TimeUp:
        row = {"status": "timeout", "line": f"over {LIMIT_S} s"}
    except (UserError, SystemExit) as exc:
        row = {"status": "refused", "line": str(exc)}
    except BaseException as exc:  # noqa: BLE001 - the sweep records every traceback as a row
        last = traceback.extract_tb(exc.__traceback__)[-1]
        row = {"status": "traceback", "line": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
                                              f" ({Path(last.filename).name}:{last.lineno})"}
    finally:
        signal.alarm(0)
    if "line" in row:  # the temporary folder's path means nothing in the results
        row["line"] = row["line"].replace(str(folder), f"<{kind}>")
    row["seconds"] = round(time.time() - start, 1)
    return row


def write_results(rows: dict, total: int) -> dict:
    """The results files for the rows so far (rewritten after each type, so an interrupted sweep leaves what it
    measured, said as N of total)."""
    counts = {s: sum(r["status"] == s for r in rows.values()) for s in
              ("ok", "refused", "traceback", "timeout", "crash", "no config")}
    out = Path(__file__).parent / "results"
    (out / "architectures.json").write_text(json.dumps({"meta": meta(), "swept": len(rows), "types": total,
                                                        "counts": counts, "rows": rows}, indent=1) + "\n")
    lines = ["# Architecture sweep", "", f"{measured_line('architectures.py')}. The default config of each model "
             f"type transformers maps to a causal LM or an image-text-to-text model ({len(rows)} of {total} swept), "
             "estimated with zero3 on 8 x H100-80GB at seq 1024, micro-batch 1: " +
             ", ".join(f"{n} {s}" for s, n in counts.items()) + ". A traceback is a bug; a refusal of a default "
             "config that names a null field is what a real checkpoint's config fills. Seconds are wall time on a "
             "shared 2-core machine.", "",
             "| model type | result | parameters | peak GiB/GPU | activations GiB | seconds |", "|---|---|---|---|---|---|"]
    for kind, r in rows.items():
        if r["status"] == "ok":
            lines.append(f"| {kind} | ok | {r['params']:,} | {r['peak_gib']} | {r['activations_gib']} | "
                         f"{r['seconds']} |")
        else:
            words = r["line"].replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {kind} | {r['status']}: {words} | | | | {r.get('seconds', '')} |")
    (out / "architectures.md").write_text("\n".join(lines) + "\n")
    return counts


def main(argv: list[str]) -> int:
    def time_up(*_):
        raise _TimeUp()

    signal.signal(signal.SIGALRM, time_up)
    resume = argv[:1] == ["--resume"]  # keep the rows an interrupted sweep wrote, sweep the rest
    argv = argv[1:] if resume else argv
    kinds = [k for k in model_types() if not argv or k in argv]
    saved = Path(__file__).parent / "results" / "architectures.json"
    rows = json.loads(saved.read_text())["rows"] if resume and saved.exists() else {}
    running = Path(tempfile.gettempdir()) / "architectures-sweep-running"  # the type a dead process was on
    if resume and running.exists() and running.read_text() not in rows:
        rows[running.read_text()] = {"status": "crash", "line": "the process aborted (no Python exception to catch)"}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in (k for k in kinds if k not in rows):
            running.write_text(kind)
            rows[kind] = sweep_one(kind, Path(tmp) / kind)
            print(kind, json.dumps(rows[kind]), flush=True)
            if not argv:
                write_results(rows, len(kinds))
    if not argv:
        print(write_results(rows, len(kinds)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
