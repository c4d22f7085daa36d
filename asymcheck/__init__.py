"""asymcheck: per-iteration asymmetric snapshots of PyTorch training into asymstore."""
