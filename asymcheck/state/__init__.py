"""The training state of one step: what is captured, how it is encoded without pickle, how it loads back."""
