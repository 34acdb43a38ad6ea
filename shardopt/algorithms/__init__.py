"""The algorithms: one record each (hyperparameters, state, bucket step), the registry by name, and their pure math."""
