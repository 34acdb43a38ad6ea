"""The optimizer classes and their step: plans, the pre-step agreement, clipping, checks, traffic, param groups."""
