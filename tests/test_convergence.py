"""Single-process convergence: Dion (rank_fraction 1/4) and Sign-Muon train a small MLP to the loss
that AdamW with a tuned learning rate reaches in the same number of steps.

Task: 10-way classification of x ~ N(0, I₃₂) labelled by a fixed random two-layer ReLU teacher
(argmax of its logits; classes are unbalanced, the boundary is nonlinear). Every step draws a fresh
batch from a fixed generator, so there is no overfitting and the run is deterministic; the loss is
measured on a fixed held-out set of 4096 points. The student is 32→128→128→10; the two hidden
weights are matrices (Dion / Sign-Muon), biases and the "head" layer use AdamW
(`shardopt.param_groups`). All runs use the same linear-decay LambdaLR schedule.
"""

import pytest
import torch
from torch import nn

import shardopt

INPUTS, HIDDEN, CLASSES, TEACHER_HIDDEN = 32, 128, 10, 64
STEPS, BATCH = 300, 128
ADAMW_LRS = (3e-3, 1e-2, 3e-2)
NONMATRIX_LR = 1e-2
TOLERANCE = 1.1          # matrix optimizers must reach the tuned AdamW loss × 1.1 or better


class Teacher:
    def __init__(self):
        generator = torch.Generator().manual_seed(1234)
        self.w1 = torch.randn(INPUTS, TEACHER_HIDDEN, generator=generator) / INPUTS ** 0.5
        self.w2 = torch.randn(TEACHER_HIDDEN, CLASSES, generator=generator) / 8 ** 0.5
        self.test_x = torch.randn(4096, INPUTS, generator=generator)
        self.test_y = self.labels(self.test_x)

    def labels(self, x):
        return (torch.relu(x @ self.w1) @ self.w2).argmax(dim=1)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(INPUTS, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def held_out_loss(model, teacher):
    with torch.no_grad():
        return nn.functional.cross_entropy(model(teacher.test_x), teacher.test_y).item()


def train(make_optimizer, teacher):
    """Final held-out loss after STEPS steps from the same init, batches and schedule."""
    torch.manual_seed(0)
    model = MLP()
    optimizer = make_optimizer(model)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / STEPS)
    generator = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        x = torch.randn(BATCH, INPUTS, generator=generator)
        loss = nn.functional.cross_entropy(model(x), teacher.labels(x))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    return held_out_loss(model, teacher)


def dion(lr):
    return lambda model: shardopt.Dion(shardopt.param_groups(model, "dion", nonmatrix_options={"lr": NONMATRIX_LR}),
                                       lr=lr, rank_fraction=0.25, weight_decay=0.0)


def signmuon(lr):
    return lambda model: shardopt.SignMuon(shardopt.param_groups(model, "signmuon", nonmatrix_options={"lr": NONMATRIX_LR}),
                                           lr=lr, weight_decay=0.0)


@pytest.fixture(scope="module")
def teacher():
    return Teacher()


@pytest.fixture(scope="module")
def adamw_loss(teacher):
    """Best final loss over the AdamW learning-rate sweep (the tuned baseline)."""
    losses = {lr: train(lambda model: torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0), teacher)
              for lr in ADAMW_LRS}
    best_lr = min(losses, key=losses.get)
    print(f"\nAdamW final held-out loss by lr: {losses} (best lr {best_lr})")
    torch.manual_seed(0)
    initial = held_out_loss(MLP(), teacher)
    assert losses[best_lr] < 0.4 * initial, "the baseline itself must learn the task"
    assert best_lr not in (ADAMW_LRS[0], ADAMW_LRS[-1]), "the sweep must bracket AdamW's best lr"
    return losses[best_lr]


def test_dion_quarter_rank_reaches_tuned_adamw_loss(adamw_loss, teacher):
    loss = train(dion(0.03), teacher)
    print(f"\nDion (rank_fraction 1/4) final loss {loss:.4f}, AdamW {adamw_loss:.4f}")
    assert loss <= TOLERANCE * adamw_loss


def test_signmuon_reaches_tuned_adamw_loss(adamw_loss, teacher):
    loss = train(signmuon(0.003), teacher)
    print(f"\nSign-Muon final loss {loss:.4f}, AdamW {adamw_loss:.4f}")
    assert loss <= TOLERANCE * adamw_loss


def test_threshold_is_not_reached_when_matrix_weights_do_not_move(adamw_loss, teacher):
    """Control: with lr 0 for the matrix group (only biases and the head train) the same threshold
    fails, so passing it requires the matrix optimizer to do the work."""
    loss = train(dion(0.0), teacher)
    print(f"\nmatrix lr 0 final loss {loss:.4f}, AdamW {adamw_loss:.4f}")
    assert loss > TOLERANCE * adamw_loss
