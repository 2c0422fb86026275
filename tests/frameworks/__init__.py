"""Test-only harness for the real training loops (Megatron-LM, Megatron-Bridge) on CPU with gloo."""
