"""Pricing: exact GEMM FLOPs of a training pass (decoder, vision tower, DiT) from a model
description and sequence statistics. Pure Python (stdlib only): ints in, ints out."""
