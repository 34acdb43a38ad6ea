"""The "topk" outer exchange (shardopt/localsteps/formats.TopK, codec.py's pack/select/decode) on one
process: the bit packing round-trips, a decode checked by hand in float64, the bytes counted on a
counting axis against reference.outer_bytes (the formula, not the code), and the density check.
The 2-replica behaviour (bitwise-equal mean, error feedback) is in test_local_steps.py."""

import pytest
import torch

import reference
import shardopt
from shardopt.localsteps.codec import (decode_picks, encode_picks, offset_bits, pack_bits, picks_per_chunk,
                                       select_topk, unpack_bits)
from shardopt.localsteps.formats import TopK, outer_format
from shardopt.localsteps.traffic import sync_bytes
from shardopt.wire.comm import CountingAxis


@pytest.mark.parametrize("bits", [1, 2, 7, 9, 14])
def test_pack_bits_round_trips_and_takes_the_fewest_whole_bytes(bits):
    generator = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2 ** bits, (3, 13), generator=generator)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, -(-13 * bits // 8))
    assert torch.equal(unpack_bits(packed, bits, 13), codes)


def test_pack_bits_puts_the_least_significant_bit_first():
    # codes 1 (01), 2 (10), 3 (11) in 2 bits: stream 1,0, 0,1, 1,1 → byte 0b00_11_10_01
    assert pack_bits(torch.tensor([1, 2, 3]), 2).tolist() == [0b111001]


def test_picks_and_offset_bits():
    assert [picks_per_chunk(128, d) for d in (0.01, 0.02, 0.03)] == [1, 3, 4]
    assert picks_per_chunk(4096, 0.02) == 82 and picks_per_chunk(16, 0.001) == 1
    assert [offset_bits(b) for b in (1, 2, 16, 100, 128, 4096)] == [0, 1, 4, 7, 7, 12]


def test_decode_by_hand_float64():
    """One chunk of 8, k = 3: the picks are the 3 largest |x|; s = max |x| = 4; |x| ≥ 3 → ±4, else ±2."""
    x = torch.tensor([[0.5, -4.0, 1.0, 2.9, 0.0, -3.5, 0.25, -1.5]], dtype=torch.float64)
    offsets, values = select_topk(x, 3)
    assert sorted(offsets[0].tolist()) == [1, 3, 5]
    scales = x.abs().amax(dim=1)
    codes = encode_picks(offsets, values, scales)
    by_offset = dict(zip(offsets[0].tolist(), codes[0].tolist()))
    assert by_offset == {1: 1 * 4 + 2 + 0, 3: 3 * 4 + 0 + 1, 5: 5 * 4 + 2 + 0}   # offset·4 + 2·big + positive
    decoded = decode_picks(codes, scales, 8)
    assert decoded.dtype == torch.float64
    assert decoded[0].tolist() == [0.0, -4.0, 0.0, 2.0, 0.0, -4.0, 0.0, 0.0]


def _counted(exchange, n, replicas, **options):
    return sync_bytes(outer_format(exchange, **options), n, CountingAxis("replicate", replicas))


@pytest.mark.parametrize("n, replicas, block, density", [(69, 2, 16, 0.02), (1000, 3, 128, 0.03), (5, 4, 16, 0.25),
                                                         (1 << 20, 4, 128, 0.02), (1 << 20, 8, 4096, 0.01)])
def test_topk_sends_its_formula(n, replicas, block, density):
    expected = reference.outer_bytes("topk", n, replicas, block, density=density)
    assert _counted("topk", n, replicas, block=block, density=density) == expected


def test_topk_bytes_at_one_million_entries_and_four_replicas_beside_sign_mean_and_int4():
    """docs/design.md §10's comparison: 2^20 entries, M = 4, block 128."""
    n, M = 1 << 20, 4
    topk = reference.outer_bytes("topk", n, M, 128, density=0.02)          # 8192 chunks · 3 picks · 9 bits
    assert topk == 3 * (27648 + 4 * 8193)
    assert topk < reference.outer_bytes("sign_mean", n, M, 128) / 2 < reference.outer_bytes("int4", n, M, 128)


def test_topk_with_one_replica_sends_nothing_and_is_exact():
    x = torch.randn(50)
    generator = TopK(16, 0.1).exchange(x, CountingAxis("replicate", 1), 0)
    with pytest.raises(StopIteration) as done:
        next(generator)
    mean, own, nonfinite = done.value.value
    assert mean is x and own is x and not nonfinite


@pytest.mark.parametrize("density", [0.0, -0.1, 1.5])
def test_density_out_of_range_names_the_parameter(density):
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match=r"density must be in \(0, 1\].*got"):
        shardopt.LocalSteps(torch.optim.SGD(params, lr=0.1), replicate_mesh=None, sync_every=2, exchange="topk",
                            density=density)
    with pytest.raises(ValueError, match="density"):
        TopK(128, density)
