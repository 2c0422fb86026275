"""``megatron-flops demo``: a small megatron-core GPT trained on CPU with the tracker in its loop.

The only place in the package, besides the adapters, that imports megatron-core (lazily, in
``run.train``); ``cpu_shim`` holds what megatron-core needs to run on a CPU, applied only there.
"""
