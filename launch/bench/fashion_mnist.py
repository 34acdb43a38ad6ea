"""Fashion-MNIST on 2 replicas: test accuracy of a small CNN per method, conv weights treated as matrices.

    python launch/bench/fashion_mnist.py --fetch        # once: apt-get download + dpkg -x into the cache
    python launch/bench/fashion_mnist.py                # → results/fashion_mnist.csv
    python launch/bench/fashion_mnist.py --steps 20 --lr-factors 1 --csv results/fashion_mnist_smoke.csv

Data: the Debian package dataset-fashion-mnist (the zalandoresearch files, 60k train / 10k test
28×28 images), fetched with `apt-get download` (run `apt-get update` once first), checked against
its pinned sha256 and unpacked with `dpkg -x` into $SHARDOPT_CACHE/data/fashion-mnist (nothing is
installed; runs only read the cache).

Model: conv 3×3 (1→32) → pool → conv 3×3 (32→64) → pool → fc 3136→128 → classifier 128→10. A conv
weight is a parameter of shape (out, in·k·k) reshaped to (out, in, k, k) in forward (`MatrixConv2d`),
so shardopt.param_groups puts it in the matrix group like a linear layer's weight (a 4-D conv weight
would go to the element-wise group); the classifier and biases go to AdamW. Each method runs under
torchrun --standalone with 2 ranks, each a replica with its own batches (each rank a node: every
byte between them is a replicate byte). shardopt's optimizers do the replicate-axis exchange (the
whole world as replicate_mesh; no DDP):

    adamw      AdamW on every parameter, full-precision gradient mean (what DDP + AdamW computes)
    muon       Muon on the matrices (full-precision mean), AdamW on the rest (lr 1e-3)
    dion_1/4, dion_1/16, signmuon   shardopt's optimizers, AdamW on the rest (lr 1e-3)

and what users run today, torch's DDP hooks and signSGD (launch/bench/peers.py), every parameter at
the one lr as in `adamw`:

    powersgd_rank1, powersgd_rank16   DDP + torch's PowerSGD hook + AdamW; rank 16 sends the bytes of
               dion_1/4 (fc, 128 × 3136, is most of them: Dion's rank 32 in bf16 = rank 16 in fp32)
    localsgd   DDP + post-local SGD, the models averaged every 8 steps, + AdamW; the replicas'
               average after the last step is the model tested
    signsgd    signSGD with majority vote (1 bit per entry), every parameter
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import math
import subprocess
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

import campaign
import peers
import runs
from integrations import data

PACKAGE, VERSION = "dataset-fashion-mnist", "0.0~git20200523.55506a9-1"
DEB_NAME = f"{PACKAGE}_{VERSION}_all.deb"
DEB_SHA256 = "39e172fe32dd318ebb3e512220c3beea2fa47d7e20bab348fb4e0922d6beefc0"
FILES = "usr/share/datasets/fashion-mnist"
FIELDS = ["method", "lr", "seed", "steps", "test_accuracy", "final_train_loss", "replicate_bytes_per_step"]
RUN_KEY = ("method", "lr", "seed")          # one run of the grid (the non-matrix lr is fixed: 1e-3)
MATCHED_RANK = runs.powersgd_matched_rank(128)     # fc (128 × 3136) carries most of Dion 1/4's bytes
# label: (peers' method, its options); torch's methods and signSGD
PEERS = {"powersgd_rank1": ("powersgd", ["--powersgd-rank", "1"]),
         f"powersgd_rank{MATCHED_RANK}": ("powersgd", ["--powersgd-rank", str(MATCHED_RANK)]),
         "localsgd": ("localsgd", ["--local-period", "8"]), "signsgd": ("signsgd", [])}
METHODS = {"adamw": 1e-3, "muon": 0.02, "dion_1/4": 0.02, "dion_1/16": 0.02, "signmuon": 1e-3,   # label: default lr
           "powersgd_rank1": 4e-3, f"powersgd_rank{MATCHED_RANK}": 4e-3, "localsgd": 4e-3, "signsgd": 1e-3}
NONMATRIX_LR = 1e-3        # the AdamW group (classifier, biases) of muon, dion and signmuon


def cache_dir() -> Path:
    return data.default_cache() / "fashion-mnist"


def fetch(cache: Path) -> None:
    """apt-get download the .deb into `cache` (if absent), check its sha256, dpkg -x it there."""
    cache.mkdir(parents=True, exist_ok=True)
    deb = cache / DEB_NAME
    if not deb.exists():
        subprocess.run(["apt-get", "download", f"{PACKAGE}={VERSION}"], cwd=cache, check=True)
    digest = hashlib.sha256(deb.read_bytes()).hexdigest()
    if digest != DEB_SHA256:
        raise RuntimeError(f"{deb} has sha256 {digest}, expected {DEB_SHA256} (the pinned version); delete it and "
                           f"fetch again, or update DEB_NAME/DEB_SHA256 if Debian moved on")
    subprocess.run(["dpkg", "-x", str(deb), str(cache / "deb")], check=True)
    print(f"fashion-mnist: unpacked {deb.name} into {cache / 'deb' / FILES}")


def load(cache: Path, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(images float (N, 1, 28, 28) in [0, 1] normalized, labels int64 (N,)) of "train" or "t10k"."""
    root = cache / "deb" / FILES
    path = root / f"{split}-images-idx3-ubyte.gz"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found; fetch the data first: python launch/bench/fashion_mnist.py --fetch")
    images = np.frombuffer(gzip.decompress(path.read_bytes()), np.uint8, offset=16).reshape(-1, 1, 28, 28)
    labels = np.frombuffer(gzip.decompress((root / f"{split}-labels-idx1-ubyte.gz").read_bytes()), np.uint8, offset=8)
    x = torch.from_numpy(images.astype(np.float32) / 255.0)
    return (x - 0.286) / 0.353, torch.from_numpy(labels.astype(np.int64))


class MatrixConv2d(nn.Module):
    """Conv2d without bias whose weight is stored as the matrix W (out, in·k·k): y = conv(x, W.view(out, in, k, k)).
    The same convolution as nn.Conv2d; a matrix optimizer orthogonalizes W (the im2col view of the kernel)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, padding: int = 0):
        super().__init__()
        self.shape = (out_channels, in_channels, kernel_size, kernel_size)
        self.padding = padding
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels * kernel_size * kernel_size))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))   # nn.Conv2d's default (fan_in = in·k·k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight.view(self.shape), padding=self.padding)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = MatrixConv2d(1, 32, 3, padding=1)
        self.conv2 = MatrixConv2d(32, 64, 3, padding=1)
        self.fc = nn.Linear(64 * 7 * 7, 128, bias=False)
        self.classifier = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.classifier(F.relu(self.fc(x.flatten(1))))


def optimizer(model: nn.Module, method: str, lr: float, seed: int):
    """The shardopt optimizer of `method` (not one of PEERS) with this world as its replicate axis."""
    import torch.distributed as dist
    import shardopt
    world = dict(replicate_mesh=dist.group.WORLD, seed=seed)
    if method == "adamw":
        return shardopt.ShardOptimizer([{"params": list(model.parameters()), "algorithm": "adamw", "lr": lr}], {}, **world)
    algorithm = {"muon": "muon", "signmuon": "signmuon"}.get(method, "dion")
    groups = shardopt.param_groups(model, algorithm, "adamw", nonmatrix_options=dict(lr=NONMATRIX_LR, weight_decay=0.0))
    if algorithm == "dion":
        return shardopt.Dion(groups, lr=lr, rank_fraction=1 / int(method.split("/")[1]), **world)
    if algorithm == "signmuon":
        return shardopt.SignMuon(groups, lr=lr, **world)
    return shardopt.ShardOptimizer(groups, dict(lr=lr, momentum=0.95), **world)


def method_peer(model: nn.Module, method: str, lr: float, seed: int) -> peers.Peer:
    """`method` on this world (each rank a replica and a node) as a peers.Peer: forward through .net, then .step()."""
    if method in PEERS:
        name, argv = PEERS[method]
        options = argparse.ArgumentParser()
        peers.add_arguments(options)
        return peers.build(model, name, lr, lr, options.parse_args(argv), local_world=1, seed=seed)
    opt = optimizer(model, method, lr, seed)
    return peers.Peer(model, model, [opt], shardopt_optimizer=opt)


def train(args) -> None:
    """One method on this torchrun world (each rank a replica); rank 0 puts its row into args.csv (replacing
    a row of the same method, lr and seed; the others stay, so a grid can be widened later)."""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    x_train, y_train = load(args.cache, "train")
    torch.manual_seed(args.seed)
    model = CNN()
    peer = method_peer(model, args.method, args.lr, args.seed)
    sent, losses = 0, []
    for step in range(1, args.steps + 1):
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
        index = torch.randint(len(x_train), (args.batch_size,), generator=generator)
        warm = min(1.0, step / max(1, args.warmup))
        decay = 0.1 + 0.45 * (1 + math.cos(math.pi * step / args.steps))
        for group in peer.param_groups():
            group.setdefault("base_lr", group["lr"])
            group["lr"] = group["base_lr"] * min(warm, decay)
        loss = F.cross_entropy(peer.net(x_train[index]), y_train[index])
        loss.backward()
        peer.step()
        sent += peer.sent()[0]
        losses.append(loss.item())
    peer.synchronize()                  # local SGD: the replicas' average is the model tested
    sent += peer.sent()[0]
    if not peers.replicas_equal(model):
        raise SystemExit(f"{args.method}: the replicas' weights differ after training")
    peer.close()
    if rank == 0:
        x_test, y_test = load(args.cache, "t10k")
        with torch.no_grad():
            correct = sum(int((model(xb).argmax(1) == yb).sum()) for xb, yb in zip(x_test.split(1000), y_test.split(1000)))
        row = {"method": args.method, "lr": f"{args.lr:g}", "seed": args.seed, "steps": args.steps,
               "test_accuracy": f"{correct / len(y_test):.4f}", "final_train_loss": f"{np.mean(losses[-20:]):.4f}",
               "replicate_bytes_per_step": sent // args.steps}
        campaign.Campaign(args.csv, FIELDS, RUN_KEY).add(row)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fetch", action="store_true", help="download and unpack the data, then stop")
    parser.add_argument("--cache", type=Path, default=cache_dir())
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--lr-factors", nargs="+", type=float, default=[0.5, 1.0, 2.0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64, help="images per replica per step")
    parser.add_argument("--run-timeout", type=float, default=1800.0)
    parser.add_argument("--csv", type=Path, default=campaign.ROOT / "results" / "fashion_mnist.csv")
    parser.add_argument("--method", help=argparse.SUPPRESS)   # (one run, under torchrun)
    parser.add_argument("--lr", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fetch:
        fetch(args.cache)
        return
    if args.method:
        train(args)
        return
    load(args.cache, "t10k")   # the data is there (a clear error now, not in every run)
    for method in args.methods:
        for factor in args.lr_factors:
            for seed in args.seeds:
                argv = [__file__, "--method", method, "--lr", f"{METHODS[method] * factor:g}", "--seed", str(seed),
                        "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
                        "--cache", str(args.cache), "--csv", str(args.csv)]
                log = campaign.ROOT / "runs" / "fashion_mnist" / f"{method.replace('/', '_')}_{factor:g}_{seed}.txt"
                campaign.run_local(argv, 2, log, args.run_timeout)
                print(log.read_text().strip().splitlines()[-1] if log.exists() else "", flush=True)
    campaign.print_table(campaign.read_csv(args.csv))
    print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
