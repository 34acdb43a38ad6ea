"""Adapters for the frameworks that own the training loop (docs/design.md §11), each importing its framework lazily."""
