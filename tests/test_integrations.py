"""GeoFP8 inside real frameworks (Lightning, Accelerate, the transformers Trainer): each one
trains a tiny Llama on 2 gloo ranks, and must match the raw DDP loop with the same batches."""

import os

import pytest
import torch
from distributed import run_ranks
from integration_setup import CONFIG, LR, STEPS, flat_params, raw_ddp, rank_batches, tiny_llama

pytestmark = pytest.mark.distributed


def _check_run(results, metric_rows):
    """Both ranks: GeoFP8 active, parameters identical to each other and to raw DDP."""
    (losses0, params0, stats0, ref0), (losses1, params1, stats1, _) = results
    ref_losses, ref_params, ref_stats = ref0
    assert stats0["step"] == STEPS and stats1["step"] == STEPS
    assert stats0["bytes_sent"] > 0 and stats0["bytes_per_element"] < 2.0  # FP32 ring: 4.0
    assert stats0["geometry_layers"], "no layer took the geometry branch"
    assert torch.equal(params0, params1), "ranks diverged"
    assert losses0[-1] < losses0[0]
    assert losses0 == ref_losses and torch.equal(params0, ref_params)
    assert stats0["bytes_sent"] == ref_stats["bytes_sent"]
    assert [r["geofp8/step"] for r in metric_rows] == [float(s) for s in range(1, STEPS + 1)]
    # refresh steps also carry factors; the others are FP8 payload + scales: ≈ 2(N−1)/N bytes
    per_element = [r["geofp8/bytes_per_element"] for r in metric_rows]
    assert 1.0 < min(per_element) < 1.1, per_element
    assert metric_rows[-1]["geofp8/bytes_per_step"] == stats0["bytes_sent"]


# -- PyTorch Lightning -----------------------------------------------------------------------

def _lightning_worker(rank, world_size):
    os.environ["LOCAL_RANK"] = str(rank)  # Lightning: processes launched externally
    import lightning as L
    from lightning.pytorch.loggers import Logger

    from geofp8.integrations.lightning import GeoFP8DDPStrategy

    class LitLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_llama()
            self.losses = []

        def training_step(self, tokens, batch_idx):
            loss = self.model(input_ids=tokens, labels=tokens).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR)

    class Rows(Logger):  # an in-memory Lightning logger (rank 0 only, like all of them)
        name, version, rows = "rows", 0, []

        def log_metrics(self, metrics, step=None):
            if any(k.startswith("geofp8/") for k in metrics):
                self.rows.append(metrics)

        def log_hyperparams(self, *args, **kwargs):
            pass

    lit, rows = LitLM(), Rows()
    strategy = GeoFP8DDPStrategy(config=CONFIG)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy,
                        max_steps=STEPS, logger=rows, log_every_n_steps=1,
                        use_distributed_sampler=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(rank_batches(rank, world_size), batch_size=None)
    trainer.fit(lit, loader)
    stats = strategy.geofp8_state.stats()
    return (lit.losses, flat_params(lit.model), stats,
            raw_ddp(rank, world_size) + (rows.rows if rank == 0 else None,))


def test_lightning_strategy_trains_with_geofp8_on_cpu():
    results = run_ranks(_lightning_worker, world_size=2, timeout=180)
    rows = results[0][3][3]
    results[0] = (*results[0][:3], results[0][3][:3])
    _check_run(results, rows)
