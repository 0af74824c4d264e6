"""An HF Trainer script that trains the way a toolkit plan says, with the settings the plan lists.

    accelerate launch --config_file PLAN/accelerate_config.yaml trainer_script.py --plan PLAN \
        --model MODEL --data CORPUS_DIR --output OUT

The plan's TrainingArguments (batch, accumulation, precision, optimizer, clipping, checkpointing) come from
PLAN/training_args.json; the engine (ZeRO / FSDP2) comes from the accelerate config. Everything else (learning rate,
steps, logging) is this script's own.
"""

from __future__ import annotations

import argparse

from _support import cpu_training_kwargs, packed_blocks, plan_settings, report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plan")
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True, help="a folder with train.txt")
    parser.add_argument("--output", required=True)
    parser.add_argument("--max_steps", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    cli = parser.parse_args()

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, default_data_collator

    settings = plan_settings(cli.plan)
    args = TrainingArguments(output_dir=cli.output, max_steps=cli.max_steps, learning_rate=cli.learning_rate,
                             lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
                             seed=7, **cpu_training_kwargs(settings["training_arguments"]))
    # After TrainingArguments: under a ZeRO-3 plan the model is then created already partitioned.
    model = AutoModelForCausalLM.from_pretrained(cli.model)
    tokenizer = AutoTokenizer.from_pretrained(cli.model)
    train = Dataset.from_dict(packed_blocks(cli.data, tokenizer, settings["sft_config"]["max_length"]))
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=default_data_collator)
    trainer.train()
    report(args.process_index, [e["loss"] for e in trainer.state.log_history if "loss" in e], trainer.model,
           args.device)


if __name__ == "__main__":
    main()
