"""The read path: verifying a stored version, loading it into tensors, what a restore returns, reshard plans."""
