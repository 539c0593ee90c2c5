"""Tasks for ``autoaccum probe --task _cli_tasks:NAME`` in the CLI tests (tests/ is on sys.path)."""

import torch
import torch.nn.functional as F
from _probe_models import mlp, mlp_batch, mlp_loss

import autoaccum


def tiny() -> autoaccum.Task:
    return autoaccum.Task(model=mlp(), loss_fn=mlp_loss, make_batch=mlp_batch(), name="tiny mlp")


def bad_loss() -> autoaccum.Task:
    return autoaccum.Task(model=mlp(), loss_fn=lambda m, b: m(b[0]).pow(2), make_batch=mlp_batch())


def wrong_batch() -> autoaccum.Task:
    return autoaccum.Task(model=mlp(), loss_fn=mlp_loss, make_batch=lambda b: mlp_batch()(2 * b))


def frozen() -> autoaccum.Task:
    return autoaccum.Task(model=mlp().requires_grad_(False), loss_fn=mlp_loss, make_batch=mlp_batch())


def not_a_task() -> int:
    return 42


CONSTANT = torch.zeros(1)  # a name that is not callable


def variable_length() -> autoaccum.Task:
    """A small causal LM whose data declares its lengths: probed by length, planned by tokens."""
    from autoaccum.demo import TinyGPT, token_loss

    torch.manual_seed(0)
    lengths = tuple([8] * 40 + [16] * 20 + [48] * 4)
    return autoaccum.Task(model=TinyGPT(seq_len=48, dim=32), loss_fn=token_loss,
                          make_batch=lambda b, length: torch.randint(0, 256, (b, length + 1)), lengths=lengths,
                          name="variable-length LM")


def half_model() -> autoaccum.Task:
    """A float16 model fed float32 data: torch's raw dtype error, explained (the README promises one line)."""
    return autoaccum.Task(model=mlp().half(), loss_fn=mlp_loss, make_batch=mlp_batch())


def swapped_loss() -> autoaccum.Task:
    """``loss_fn(batch, model)`` under other names than batch and model: caught when it calls the batch."""
    return autoaccum.Task(model=mlp(), loss_fn=lambda b, m: F.cross_entropy(m(b[0]), b[1]), make_batch=mlp_batch())


class Rows(torch.utils.data.Dataset):
    """40 feature rows with labels, each row a dict (a dataset a DataLoader collates)."""

    def __init__(self, n: int = 40) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 32, generator=g), torch.randint(0, 8, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"features": self.x[i], "label": int(self.y[i])}


def pairs(rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """The loader's collate_fn: dict rows -> (features, labels)."""
    return torch.stack([r["features"] for r in rows]), torch.tensor([r["label"] for r in rows])


def from_loader() -> autoaccum.Task:
    """The user's own data: a DataLoader's dataset and collate_fn (40 rows: larger sizes repeat them)."""
    loader = torch.utils.data.DataLoader(Rows(), batch_size=16, shuffle=True, collate_fn=pairs)
    return autoaccum.Task.from_data(mlp(), mlp_loss, loader, name="mlp on its rows")
