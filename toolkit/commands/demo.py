"""`toolkit demo`: the whole product on an embedded default, on this machine's CPU, with nothing downloaded.

1. estimate: per-GPU memory of a built-in model (Llama-3-8B, ZeRO-3, 8 x H100, seq 8192);
2. plan: every strategy ranked for a built-in model and cluster (Llama-3-70B on 8 x 8 x H100);
3. a tiny model of a real architecture (Llama), a tokenizer trained here, a corpus of the Python standard
   library's documentation; planned for 2 GPUs, emitted, and trained with `accelerate launch -m toolkit.train`
   on 2 CPU processes over gloo; then the trained model, reloaded with from_pretrained, writes a sample.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from toolkit import bounds
from toolkit.bounds import int_arg, text_arg
from toolkit.errors import UserError

def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="estimate, plan, emit and train a tiny model end to end on CPU")
    p.add_argument("--workdir", type=text_arg("--workdir"),
                   help="where the demo writes (default: a new runs/demo-DATE-TIME)")
    p.add_argument("--steps", type=int_arg("--steps", bounds.STEPS), default=200,
                   help="training steps of the tiny model (default %(default)s)")
    p.add_argument("--force", action="store_true", help="redo the demo in a --workdir that is not empty")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args) -> int:
    import time

    workdir = args.workdir or time.strftime("runs/demo-%Y%m%d-%H%M%S")
    from pathlib import Path

    from toolkit.fileio import check_folder_path

    check_folder_path(Path(workdir), "--workdir")  # a file, or a file on its way: refused before any stage runs
    return run_demo(workdir, steps=args.steps, force=args.force)


PROMPT = "Return a new"


def _banner(text: str) -> None:
    print(f"\n=== {text} ===", flush=True)


def run_demo(workdir: str | Path, *, steps: int = 60, force: bool = False) -> int:
    from toolkit.commands import execute as cli  # the CLI's own entry: parsing, the command, its exit code

    work = Path(workdir)
    plan_dir, model_dir, data_dir, out_dir = (work / n for n in ("plan", "model", "data", "out"))
    if work.exists() and any(work.iterdir()) and not force:
        raise UserError(f"{work} is not empty; pass --force to redo the demo there, or --workdir DIR")

    _banner("1. estimate: toolkit estimate llama-3-8b --gpus 8xH100-80GB --strategy zero3 --seq 8192 --micro-batch 2")
    cli(["estimate", "llama-3-8b", "--gpus", "8xH100-80GB", "--strategy", "zero3", "--seq", "8192",
         "--micro-batch", "2"])

    _banner("2. plan: toolkit plan llama-3-70b --gpus 8x8xH100-80GB --seq 8192 --global-batch 512 --top 5")
    cli(["plan", "llama-3-70b", "--gpus", "8x8xH100-80GB", "--seq", "8192", "--global-batch", "512", "--top", "5"])

    _banner("3. a tiny Llama, a tokenizer trained here, the standard library's documentation as corpus")
    from toolkit.run import tiny

    tiny.make_tiny_model("llama", model_dir, layers=4, hidden=128, heads=4, kv_heads=2, ffn=344, vocab_size=1024,
                         corpus_chars=300_000)
    tiny.write_corpus(data_dir, max_chars=600_000)
    print(f"model: {model_dir} | corpus: {data_dir}", flush=True)

    plan_argv = ["plan", str(model_dir), "--gpus", "2xA100-80GB", "--seq", "128", "--global-batch", "16",
                 "--precision", "fp32", "--top", "4", "--out", str(plan_dir)] + (["--force"] if force else [])
    _banner("4. toolkit " + shlex.join(plan_argv))
    if cli(plan_argv) != 0:
        return 1

    from toolkit.run.launcher import launch_command, run

    train_argv = ["--model", str(model_dir), "--data", str(data_dir), "--output", str(out_dir),
                  "--max-steps", str(steps), "--save-steps", str(max(1, steps // 2)), "--logging-steps", "10",
                  "--lr", "3e-3", "--warmup-steps", "5", "--eval-steps", str(steps)]
    command = launch_command(plan_dir, train_argv)
    _banner("5. train on 2 CPU processes: " + shlex.join(command))
    code = run(command, env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    if code != 0:
        print(f"training failed with exit code {code}", flush=True)
        return code

    _banner(f"6. sample from the trained model ({out_dir})")
    print(sample(out_dir, PROMPT), flush=True)
    return 0


def sample(model_dir: str | Path, prompt: str, *, new_tokens: int = 40) -> str:
    import torch
    from transformers import AutoTokenizer

    from toolkit.inputs.modelconfig import load_pretrained

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_pretrained(model_dir)
    model.eval()
    torch.manual_seed(0)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=True, top_k=20, temperature=0.8,
                             pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0], skip_special_tokens=True)
