"""Training (an offline procedure that runs a model): data preparation and the training loop."""
