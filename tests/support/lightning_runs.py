"""Tiny Lightning modules and runs for tests/integrations/test_lightning.py (importable by
the ranks of ``run_ranks``)."""

from __future__ import annotations

import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset


class TinyModule(pl.LightningModule):
    """A two-layer regression with BatchNorm (a buffer that changes in forward) and AdamW."""

    def __init__(self, width: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.BatchNorm1d(width), torch.nn.ReLU(),
                                       torch.nn.Linear(width, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 3, 0.5)}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(16, 8, generator=g)  # two batches an epoch: checkpoints at epoch ends
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8, shuffle=False)


def trainer(root, max_steps: int, plugins=(), every: int = 2, top_k: int = 2, filename: str | None = None,
            **kwargs) -> pl.Trainer:
    checkpoints = ModelCheckpoint(dirpath=str(root), every_n_train_steps=every, save_top_k=top_k, monitor="step",
                                  mode="max", save_last=True, filename=filename,
                                  auto_insert_metric_name=filename is None)
    return pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, plugins=list(plugins),
                      callbacks=[checkpoints], logger=False, enable_progress_bar=False, enable_model_summary=False,
                      deterministic=True, **kwargs)


def parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class ShardedModule(TinyModule):
    """TinyModule sharded with FSDP2 over the strategy's data-parallel mesh (no BatchNorm: FSDP2
    keeps buffers replicated, and the tiny batches differ per rank)."""

    def __init__(self, width: int = 16):
        pl.LightningModule.__init__(self)
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 3),
                                       torch.nn.Linear(3, 1))

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


def sharded_fit(rank: int, world_size: int, root: str, steps: int, ckpt_path: str | None) -> dict:
    """One rank of a ModelParallelStrategy (FSDP2 on a cpu DeviceMesh) run writing our sharded checkpoints;
    returns the full (gathered) parameters and optimizer state at the end."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    from ckpt.integrations.lightning import CkptModelParallelStrategy

    strategy = CkptModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)
    checkpoints = ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1, save_last=True)
    run = pl.Trainer(max_steps=steps, accelerator="cpu", devices=world_size, strategy=strategy, callbacks=[checkpoints],
                     logger=False, enable_progress_bar=False, enable_model_summary=False)
    module = ShardedModule()
    run.fit(module, ckpt_path=ckpt_path)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = run.strategy.model
    optimizer = run.optimizers[0]
    return {"model": get_model_state_dict(model, options=options),
            "optim": get_optimizer_state_dict(model, optimizer, options=options).get("state", {})}  # rank 0 holds it
