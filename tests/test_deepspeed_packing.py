"""shardopt/deepspeed/packing.py: an fp32 master split into its bf16 weight (torch's round to nearest even), its low
16 bits and the rounding bit, and joined again, bitwise, at every kind of value; the bits of a NaN are not kept."""

import pytest
import torch

from shardopt.deepspeed.packing import join_master, split_master


def _floats(patterns: list[int]) -> torch.Tensor:
    """fp32 values from their bit patterns (uint32 as Python ints)."""
    return torch.tensor([p - (1 << 32) if p >= 1 << 31 else p for p in patterns], dtype=torch.int32).view(torch.float32)


TIES_EVEN_DOWN = [0x3F808000, 0xBF808000, 0x00008000, 0x80008000]    # low = 0x8000, even high: rounds down
TIES_ODD_UP = [0x3F818000, 0xBF818000, 0x00018000, 0x80018000]       # odd high: rounds up (u = 1)
NEAR_TIES = [0x3F807FFF, 0x3F808001, 0xBF807FFF, 0xBF808001, 0x3F80FFFF, 0xBF80FFFF]
ZEROS_AND_SUBNORMALS = [0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF, 0x0000FFFF]
TO_INFINITY = [0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0xFF7F8000, 0x7F7E8000]   # round to ±inf; a tie that stays finite
INFINITIES = [0x7F800000, 0xFF800000]


def _round_trip(master: torch.Tensor):
    weight = torch.empty(master.shape, dtype=torch.bfloat16)
    low, rounded_up = split_master(master, weight)
    return weight, low, rounded_up, join_master(weight, low, rounded_up)


@pytest.mark.parametrize("patterns", [TIES_EVEN_DOWN, TIES_ODD_UP, NEAR_TIES, ZEROS_AND_SUBNORMALS, TO_INFINITY,
                                      INFINITIES], ids=["ties-even", "ties-odd", "near-ties", "zeros-subnormals",
                                                        "to-infinity", "infinities"])
def test_split_and_join_round_trip_bitwise_at_edge_values(patterns):
    master = _floats(patterns)
    weight, low, rounded_up, rebuilt = _round_trip(master)
    assert torch.equal(weight.view(torch.int16), master.to(torch.bfloat16).view(torch.int16))   # torch's own rounding
    assert torch.equal(rebuilt.view(torch.int32), master.view(torch.int32))
    assert low.dtype == torch.int16 and rounded_up.dtype == torch.uint8 and rounded_up.numel() == -(-len(patterns) // 8)


def test_the_rounding_bit_is_set_where_rne_rounds_the_magnitude_up():
    _, _, rounded_up, _ = _round_trip(_floats(TIES_EVEN_DOWN + TIES_ODD_UP))
    assert rounded_up.tolist() == [0b11110000]


@pytest.mark.parametrize("shape", [(1,), (7,), (64,), (33, 17), (3, 5, 9)])
def test_random_fp32_of_every_magnitude_round_trips_bitwise(shape):
    generator = torch.Generator().manual_seed(sum(shape))
    patterns = torch.randint(-(1 << 31), 1 << 31, shape, generator=generator, dtype=torch.int64).to(torch.int32)
    master = patterns.view(torch.float32)
    master = torch.where(master.isnan(), torch.randn(shape, generator=generator), master)   # NaNs: the next test
    weight, low, _, rebuilt = _round_trip(master)
    assert low.shape == master.shape and rebuilt.shape == master.shape
    assert torch.equal(rebuilt.view(torch.int32), master.view(torch.int32))


def test_a_nan_master_rebuilds_as_a_nan():
    master = _floats([0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x3F800000])
    _, _, _, rebuilt = _round_trip(master)
    assert rebuilt[:3].isnan().all() and rebuilt[3].item() == 1.0


def test_split_refuses_what_is_not_an_fp32_master_and_its_bf16_weight():
    with pytest.raises(ValueError, match="fp32 master and a bf16 weight"):
        split_master(torch.zeros(4, dtype=torch.float16), torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="of one shape"):
        split_master(torch.zeros(4), torch.zeros(5, dtype=torch.bfloat16))
