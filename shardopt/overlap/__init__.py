"""The exchange during backward (docs/design.md §12): the round of bucket steps started in backward."""
