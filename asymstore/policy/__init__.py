"""Policy: the write cost model and its calibration, compression and retention decisions."""
