"""``retune.prediction``: a step's peak on fake tensors and the predicted search."""
