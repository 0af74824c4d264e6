"""A custom accelerate training loop with the numbers a toolkit plan lists.

    accelerate launch --config_file PLAN/accelerate_config.yaml accelerate_loop.py --plan PLAN \
        --model MODEL --data CORPUS_DIR

From PLAN/training_args.json ("accelerate_loop"): the DataLoader's batch size, the Accelerator's accumulation, the
clipping norm, activation checkpointing, and whether DeepSpeed owns the optimizer (optimizer-offload plans: then
the loop passes accelerate.utils.DummyOptim, which accelerate requires next to the JSON's "optimizer" block).
"""

from __future__ import annotations

from _support import packed_blocks, parse_arguments, report

from toolkit.train.own_script import accelerate_loop


def main() -> None:
    cli = parse_arguments("a folder with train.txt", output=False)

    import torch
    from accelerate import Accelerator
    from accelerate.utils import DummyOptim, set_seed
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator

    loop = accelerate_loop(cli.plan)  # before the Accelerator: on a machine without a GPU, the gloo set-up
    accelerator = Accelerator(gradient_accumulation_steps=loop["gradient_accumulation_steps"],
                              mixed_precision=loop["mixed_precision"])
    set_seed(7)
    model = AutoModelForCausalLM.from_pretrained(cli.model, dtype=getattr(torch, loop["model_dtype"]))
    if loop["gradient_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tokenizer = AutoTokenizer.from_pretrained(cli.model)
    data = Dataset.from_dict(packed_blocks(cli.data, tokenizer, loop["sequence_length"]))
    loader = torch.utils.data.DataLoader(data, batch_size=loop["dataloader_batch_size"], shuffle=True,
                                         collate_fn=default_data_collator, drop_last=True)
    optimizer = (DummyOptim(model.parameters(), lr=cli.learning_rate) if loop["use_dummy_optim"]
                 else torch.optim.AdamW(model.parameters(), lr=cli.learning_rate))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    model.train()
    losses, step, running = [], 0, []
    while step < cli.max_steps:
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                running.append(loss.detach())
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), loop["max_grad_norm"])
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                # The step's loss over every rank and micro-batch (the same number on every rank).
                losses.append(float(accelerator.gather(torch.stack(running)).mean()))
                running = []
                if step == cli.max_steps:
                    break
    report(accelerator.process_index, losses, model, accelerator.device)


if __name__ == "__main__":
    main()
