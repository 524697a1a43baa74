"""Fine-tune a small causal LM with PyTorch Lightning, gradients communicated by GeoFP8.

    torchrun --nproc_per_node 2 examples/lightning_example.py [--steps 60]
"""

import argparse

import lightning as L
import torch
from tiny_lm import CONFIG, text_blocks, tiny_llama

from geofp8.integrations.lightning import GeoFP8DDPStrategy


class CausalLM(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = tiny_llama()

    def training_step(self, tokens, batch_idx):
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.log("loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        m = self.trainer.callback_metrics  # GeoFP8DDPStrategy logs geofp8/* every step
        last = self.trainer.global_step == self.trainer.max_steps
        if self.global_rank == 0 and (batch_idx % 10 == 0 or last):
            print(f"step {batch_idx:4d}  loss {outputs['loss'].item():.4f}  GeoFP8 "
                  f"{m['geofp8/bytes_per_element']:.3f} B/element this step, "
                  f"{m['geofp8/run_bytes_per_element']:.3f} over the run, "
                  f"{m['geofp8/geometry_layers']:.0f} geometry layers", flush=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    steps = parser.parse_args().steps
    loader = torch.utils.data.DataLoader(text_blocks(), batch_size=8, shuffle=True)
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=steps,
                        strategy=GeoFP8DDPStrategy(config=CONFIG),  # the one line
                        logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(CausalLM(), loader)


if __name__ == "__main__":
    main()
