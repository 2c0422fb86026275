"""FSDP2's transient whole (unsharded) copies, shared by the decoder and DiT paths (stdlib only).

NB: what ``fully_shard`` keeps whole during a step (torch 2.x, ``reshard_after_forward=True``): the
unit computing, and the next one, prefetched (one unit ahead in forward and in backward by
default), have their parameters all-gathered; a unit's whole gradients wait for its
reduce-scatter after its backward. With ``reshard_after_forward`` left to its default, the root
unit is not resharded after forward (torch's ``_auto_reshard_after_forward``): its gathered
parameters, and from the head's backward on its whole gradients, stay through forward and backward
(``resident``: a DiT as ``examples/wan_dit_fsdp2.py`` wraps it). megatron-core passes ``True`` to the
root too, yet a root's pre-forward runs before every other unit's forward and its post-forward after
them, and its backward spans the whole backward: a decoder's root (and a VLM's tower in it) is
gathered all step as well (measured on CPU; see :mod:`megatron_flops.memory.decoder_fsdp`). A
formula, not measured: gloo on CPU runs each collective to completion, so which other gathered
units are alive at once (a CUDA-stream overlap) cannot be seen here.
"""

from __future__ import annotations

from collections.abc import Sequence


def unsharded_working_copies(gathered: Sequence[int], grads: Sequence[int], *, resident: int = 0) -> int:
    """Bytes: ``resident`` plus the largest sum over two neighbouring units (in forward order: the
    one computing and the one prefetched) of their gathered parameters ``gathered[i]`` and the
    larger of their whole gradients ``grads[i]``; one unit alone if there is only one."""
    if len(gathered) != len(grads):
        raise ValueError("one gathered and one gradient size per unit")
    if not gathered:
        return resident
    pairs = list(zip(range(len(gathered)), range(1, len(gathered)))) or [(0, 0)]
    return resident + max(gathered[a] + gathered[b] * (a != b) + max(grads[a], grads[b]) for a, b in pairs)
