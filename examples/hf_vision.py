"""A Hugging Face ResNet (BatchNorm) trained with ``autoaccum.fit`` on 32 x 32 images under a small budget.

The data is a dict ``{"pixel_values": ..., "labels": ...}``, as an image processor and a labelled
dataset give it; fit calls ``model(**batch)`` and uses the model's own loss (cross-entropy for
``ResNetForImageClassification``), weighted by each micro-batch's share of the samples.

BatchNorm shapes the plan twice. On 32 x 32 images the last stage's feature maps are 1 x 1, so a
micro-batch of one image cannot train at all (torch: "Expected more than 1 value per channel");
the plan's smallest micro-batch is 2, and the probe starts there. And each micro-batch is
normalised with its own statistics, not those of the global batch, so accumulation is not exactly
a full-batch step: fit's guard warns once (a ``UserWarning``, on stderr) and names the remedies.

No download: the model is built from a small config, the images are synthetic (a fixed pattern
per class plus noise, which the model learns). ``budget="3 MiB"`` emulates a small device on the
CPU: 64 images do not fit at once. Runs in seconds (most of it importing transformers):

    python examples/hf_vision.py
"""

import logging

import torch
from transformers import ResNetConfig, ResNetForImageClassification

import autoaccum

CLASSES, SIZE = 10, 32
BUDGET = "3 MiB"  # an emulated device: a global batch of 64 images needs more


def make_images(num: int, seed: int) -> dict[str, torch.Tensor]:
    """``num`` images of 3 x SIZE x SIZE: a fixed random pattern per class plus as much noise; and the labels."""
    patterns = torch.randn(CLASSES, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (num,), generator=g)
    pixels = patterns[labels] + torch.randn(num, 3, SIZE, SIZE, generator=g)
    return {"pixel_values": pixels, "labels": labels}


def main() -> None:
    logging.basicConfig(format="%(message)s")
    logging.getLogger("autoaccum.fit").setLevel(logging.INFO)  # fit's banner and summary go through logging
    torch.manual_seed(0)
    config = ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1],
                          num_labels=CLASSES)
    model = ResNetForImageClassification(config)
    data, held_out = make_images(512, seed=1), make_images(256, seed=2)
    print(f"{len(data['labels'])} images of 3 x {SIZE} x {SIZE}, ResNet with {model.num_parameters():,} parameters")

    result = autoaccum.fit(model, data, target_batch=64, lr=3e-3, epochs=2, budget=BUDGET)

    sizes = ", ".join(f"{c.micro_batch} ({c.status}, {autoaccum.format_bytes(c.peak_bytes)})"
                      for c in result.probe.candidates)
    print(f"probe: {sizes}; {result.probe.probe_ooms} OOMs, {result.probe_time_s:.2f} s")
    print(f"plan: {result.plan.describe()}")
    model.eval()  # BatchNorm's running statistics, as after training
    with torch.no_grad():
        accuracy = (model(pixel_values=held_out["pixel_values"]).logits.argmax(-1) == held_out["labels"]).float()
    print(f"{result.optimizer_steps} steps, {result.samples_seen:,} images; loss {result.losses[0]:.3f} -> "
          f"{result.final_loss:.3f}; held-out accuracy {accuracy.mean():.0%}; {result.oom_events} OOMs in training; "
          f"peak {autoaccum.format_bytes(result.peak_bytes)} of {BUDGET}")


if __name__ == "__main__":
    main()
