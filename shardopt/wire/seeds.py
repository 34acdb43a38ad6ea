"""The one seed mix: every seed shardopt derives (a param's, a step's, a round's, a vote chunk's) is
mix_seed(parent, value), the same integer on every rank that passes the same two integers."""


def mix_seed(seed: int, value: int) -> int:
    """(seed · 1_000_003 + value) mod 2⁶³: a seed for `torch.Generator().manual_seed`, from a parent seed
    and an integer (a param index, a step, a round, a chunk owner)."""
    return (int(seed) * 1_000_003 + int(value)) % 2**63
