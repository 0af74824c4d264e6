"""An HF Trainer script that trains the way a toolkit plan says, with the settings the plan lists.

    accelerate launch --config_file PLAN/accelerate_config.yaml trainer_script.py --plan PLAN \
        --model MODEL --data CORPUS_DIR --output OUT

The plan's TrainingArguments (batch, accumulation, precision, optimizer, clipping, checkpointing) come from
PLAN/training_args.json; the engine (ZeRO / FSDP2) comes from the accelerate config. Everything else (learning rate,
steps, logging) is this script's own.
"""

from __future__ import annotations

from _support import packed_blocks, parse_arguments, report_trainer

from toolkit.train.own_script import plan_settings, training_arguments


def main() -> None:
    cli = parse_arguments("a folder with train.txt")

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, default_data_collator

    settings = plan_settings(cli.plan)
    args = TrainingArguments(output_dir=cli.output, max_steps=cli.max_steps, learning_rate=cli.learning_rate,
                             lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
                             seed=7, **training_arguments(cli.plan))
    # After TrainingArguments: under a ZeRO-3 plan the model is then created already partitioned.
    model = AutoModelForCausalLM.from_pretrained(cli.model)
    tokenizer = AutoTokenizer.from_pretrained(cli.model)
    train = Dataset.from_dict(packed_blocks(cli.data, tokenizer, settings["sft_config"]["max_length"]))
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=default_data_collator)
    trainer.train()
    report_trainer(trainer)


if __name__ == "__main__":
    main()
