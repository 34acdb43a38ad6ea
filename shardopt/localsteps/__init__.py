"""Local steps (docs/design.md §10): the outer loop over the replicate axis and its exchange formats."""
