"""Framework adapters: ``megatron_lm``, ``megatron_bridge`` and ``env`` (environment variables).

Importing this package imports no framework and patches nothing; each adapter patches only
when its ``install()`` is called.
"""
