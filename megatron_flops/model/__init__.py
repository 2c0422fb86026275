"""What a model is: ModelSpec, Hugging Face and megatron-core readers, Megatron-LM arguments,
layer patterns, validated input files. Pure Python (stdlib only)."""
