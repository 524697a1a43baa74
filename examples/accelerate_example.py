"""Fine-tune a small causal LM with Hugging Face Accelerate, gradients communicated by GeoFP8.

    torchrun --nproc_per_node 2 examples/accelerate_example.py [--steps 60]
"""

import argparse

import torch
from accelerate import Accelerator
from tiny_lm import CONFIG, text_blocks, tiny_llama

from geofp8.integrations import accelerate as geofp8


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    steps = parser.parse_args().steps
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(text_blocks(), batch_size=8, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = geofp8.enable(accelerator, model, CONFIG)  # the one line
    totals = {}
    for step, tokens in zip(range(steps), loader):
        loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        figures = geofp8.log(accelerator, state, step, totals)  # to the trackers, if any
        if step % 10 == 0 or step == steps - 1:
            accelerator.print(
                f"step {step:4d}  loss {loss.item():.4f}  GeoFP8 "
                f"{figures['geofp8/bytes_per_element']:.3f} B/element this step, "
                f"{figures['geofp8/run_bytes_per_element']:.3f} over the run, "
                f"{figures['geofp8/geometry_layers']:.0f} geometry layers")
    accelerator.end_training()


if __name__ == "__main__":
    main()
