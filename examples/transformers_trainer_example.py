"""Fine-tune a small causal LM with the transformers Trainer, gradients communicated by GeoFP8.

    torchrun --nproc_per_node 2 examples/transformers_trainer_example.py [--steps 60] [--out DIR]

The Trainer prints its logs on rank 0: the loss, and GeoFP8's figures (``geofp8/*``) from
the callback at every logging step.
"""

import argparse

import torch
from tiny_lm import CONFIG, text_blocks, tiny_llama
from transformers import Trainer, TrainingArguments

from geofp8.integrations.transformers import enable


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="runs/trainer-example",
                        help="the Trainer's output directory, one for every rank (nothing is "
                             "saved in it: save_strategy='no')")
    cli = parser.parse_args()
    dataset = [{"input_ids": block, "labels": block} for block in text_blocks()]
    args = TrainingArguments(
        output_dir=cli.out, max_steps=cli.steps,
        per_device_train_batch_size=8, learning_rate=1e-3, lr_scheduler_type="constant",
        logging_steps=10, logging_first_step=True, save_strategy="no", report_to=[],
        disable_tqdm=True, ddp_find_unused_parameters=False,
        use_cpu=not torch.cuda.is_available())
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=dataset)
    enable(trainer, CONFIG)  # the one line
    trainer.train()


if __name__ == "__main__":
    main()
