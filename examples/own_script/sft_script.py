"""A TRL SFTTrainer script on chat data (a `messages` column), with the settings a toolkit plan lists.

    accelerate launch --config_file PLAN/accelerate_config.yaml sft_script.py --plan PLAN \
        --model MODEL --data CHAT.jsonl --output OUT

SFTConfig's plan keys come from PLAN/training_args.json ("sft_config"); the loss is on the assistant's tokens only
(assistant_only_loss: the tokenizer's chat template marks them with {% generation %}). Needs `pip install trl`.
"""

from __future__ import annotations

from _support import parse_arguments, report_trainer

from toolkit.train.own_script import sft_config


def main() -> None:
    cli = parse_arguments("a .jsonl file of {\"messages\": [...]} rows")

    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    config = SFTConfig(output_dir=cli.output, max_steps=cli.max_steps, learning_rate=cli.learning_rate,
                       lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], seed=7,
                       assistant_only_loss=True, **sft_config(cli.plan))
    model = AutoModelForCausalLM.from_pretrained(cli.model)
    tokenizer = AutoTokenizer.from_pretrained(cli.model)
    train = load_dataset("json", data_files=cli.data, split="train")
    trainer = SFTTrainer(model=model, args=config, train_dataset=train, processing_class=tokenizer)
    trainer.train()
    report_trainer(trainer)


if __name__ == "__main__":
    main()
