"""GAN: a small generator and discriminator (MLPs) on scikit-learn's bundled 8x8 digits, each
trained by its own optimizer.

Launch:   saferun run recipe=gan
Expected: after 3000 steps (about a minute on 2 CPU cores), most generated images are digits
          that a classifier trained on the real ones labels confidently, spread over all ten
          classes (tests/recipes/test_gan.py measures it).

The pattern it shows: several named optimizers. `build_optimizer` returns
{"disc": ..., "gen": ...}, and `training_step` updates them itself, in the order a GAN needs:
the discriminator on real and generated images, then the generator through the updated
discriminator, on the same batch. `self.optimize(name, loss)` does each update with the same
discipline as the single-optimizer loop (only that optimizer's parameters get gradients,
averaged over processes under torchrun; unscale and clip; the non-finite guard; step;
zero_grad(set_to_none=True); its scheduler), and checkpoints hold both optimizers by name.

Each sample carries its latent code, drawn from its index alone: what a process trains on does
not depend on how the batch is split over processes (2 processes train the same GAN as one), and
a resumed run draws the same codes. Copy it with `saferun new DIR --from gan`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import saferun


class LatentDigits(Dataset):
    """(image as 64 values in [-1, 1], latent code). The dataset is `repeats` passes over the
    images, each pass with fresh codes: sample k is image k % N with the code seeded by k."""

    def __init__(self, images: torch.Tensor, latent_dim: int, repeats: int, seed: int) -> None:
        self.images = images  # (N, 64)
        self.latent_dim, self.repeats, self.seed = latent_dim, repeats, seed

    def __len__(self) -> int:
        return len(self.images) * self.repeats

    def __getitem__(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        code = torch.Generator().manual_seed(self.seed * 1_000_003 + k)
        return self.images[k % len(self.images)], torch.randn(self.latent_dim, generator=code)


def datasets(latent_dim: int = 32, repeats: int = 50, val_fraction: float = 0.2,
             split_seed: int = 0) -> tuple[LatentDigits, LatentDigits]:
    """scikit-learn's digits, split once with a fixed seed; validation has one pass of codes."""
    from sklearn.datasets import load_digits

    images = torch.tensor(load_digits().images, dtype=torch.float32).reshape(-1, 64) / 8.0 - 1.0
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(split_seed))
    n_val = int(len(images) * val_fraction)
    return (LatentDigits(images[order[n_val:]], latent_dim, repeats, seed=1),
            LatentDigits(images[order[:n_val]], latent_dim, 1, seed=2))


class DigitsGAN(nn.Module):
    """generator: latent code -> 8x8 image in [-1, 1]; discriminator: image -> real/fake logit."""

    def __init__(self, latent_dim: int = 32, hidden: int = 256) -> None:
        super().__init__()
        self.latent_dim = latent_dim
        self.generator = nn.Sequential(
            nn.Linear(latent_dim, hidden // 2), nn.LeakyReLU(0.2),
            nn.Linear(hidden // 2, hidden), nn.LeakyReLU(0.2),
            nn.Linear(hidden, 64), nn.Tanh())
        self.discriminator = nn.Sequential(
            nn.Linear(64, hidden), nn.LeakyReLU(0.2),
            nn.Linear(hidden, hidden // 2), nn.LeakyReLU(0.2),
            nn.Linear(hidden // 2, 1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """Generated images, (B, 64)."""
        return self.generator(z)


def _bce(logits: torch.Tensor, target: float) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


class DigitGrid(saferun.Callback):
    """At each validation, a grid of digits generated from fixed latent codes, logged as the
    image val/digits (TensorBoard's Images tab, or the tracker's). It needs the model, so it
    uses `on_evaluate`: eval mode, no autograd, checked to leave the model as it found it."""

    def __init__(self, side: int = 4) -> None:
        self.side = side

    def on_evaluate(self, view, model, log) -> None:
        n = self.side
        z = torch.randn(n * n, model.latent_dim, generator=torch.Generator().manual_seed(0))
        images = model.generator(z.to(next(model.parameters()).device)).cpu()  # (n * n, 64)
        grid = images.reshape(n, n, 8, 8).permute(0, 2, 1, 3).reshape(n * 8, n * 8)
        log.log_image("digits", (grid + 1) / 2)  # (H, W) in [0, 1]


class GANTrainer(saferun.Trainer):
    """Non-saturating GAN losses; the discriminator's real label smoothed to `real_label`."""

    model: DigitsGAN  # the `model` node's network, built by setup()

    def __init__(self, cfg, callbacks=(), real_label: float = 0.9, sample_digits: int = 8,
                 grid_side: int = 4) -> None:
        super().__init__(cfg, [*callbacks, *([DigitGrid(grid_side)] if grid_side > 0 else [])])
        self.real_label, self.sample_digits = real_label, sample_digits

    # (a dict of named optimizers is the several-optimizer form of build_optimizer's result)
    def build_optimizer(self, params: list[nn.Parameter]) -> dict[str, torch.optim.Optimizer]:  # type: ignore[override]
        """The `optim` node twice: one optimizer per network (frozen parameters excluded)."""
        def of(module: nn.Module) -> list[nn.Parameter]:
            mine = {id(p) for p in module.parameters()}
            return [p for p in params if id(p) in mine]

        return {"disc": super().build_optimizer(of(self.model.discriminator)),
                "gen": super().build_optimizer(of(self.model.generator))}

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        real, z = batch
        gan = self.model
        fake = gan.generator(z)
        # 1. the discriminator: real images towards real_label, generated ones towards 0
        d_real, d_fake = gan.discriminator(real), gan.discriminator(fake.detach())
        self.optimize("disc", _bce(d_real, self.real_label) + _bce(d_fake, 0.0))
        # 2. the generator, through the discriminator that just stepped: make it say "real"
        self.optimize("gen", _bce(gan.discriminator(fake), 1.0))
        return {"d_real": torch.sigmoid(d_real).mean(), "d_fake": torch.sigmoid(d_fake).mean()}

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        real, z = batch
        gan = self.model
        d_real, d_fake = gan.discriminator(real), gan.discriminator(gan.generator(z))
        return {"loss_disc": _bce(d_real, self.real_label) + _bce(d_fake, 0.0),
                "loss_gen": _bce(d_fake, 1.0),
                "d_real": torch.sigmoid(d_real).mean(), "d_fake": torch.sigmoid(d_fake).mean()}

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The images the generator makes from the batch's latent codes."""
        return self.model.generator(batch[1])

    def after_fit(self, metrics: dict[str, float]) -> None:
        """Print a few generated digits as text."""
        if self.sample_digits <= 0:
            return
        gan = self.model
        with torch.no_grad():
            z = torch.randn(self.sample_digits, gan.latent_dim,
                            generator=torch.Generator().manual_seed(0)).to(self.device)
            images = gan.generator(z).reshape(-1, 8, 8).cpu()
        shades = " .:-=+*#%@"
        for row in range(8):
            print("  ".join("".join(shades[int((v + 1) / 2 * 9.99)] for v in image[row])
                            for image in images.clamp(-1, 1)))
