"""The training step and optimizers both Lightning tests' modules use (a mixin over ``self.net``)."""

import torch


class RegressionSteps:
    def training_step(self, batch, _index):
        x, y = batch
        return (self.net(x) - y).square().mean()

    def configure_optimizers(self):
        optim = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": optim, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)}
