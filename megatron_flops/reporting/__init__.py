"""Reporting: the throughput meter (TFLOP/s/GPU, tokens/s, MFU), the peak table, the per-step
trace, run statistics, and the session that joins a tracker to them."""
