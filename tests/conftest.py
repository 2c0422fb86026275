import sys
from pathlib import Path

import pytest

# Test helpers (mcore_cpu, mcore_dist) are plain modules beside the tests.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="module")
def mcore():
    """megatron-core in this process on CPU: the CPU patches, a gloo world of size 1 and
    ``initialize_model_parallel(1, 1)`` (tests/mcore_cpu.py), the alltoall dispatcher's split
    sizes on the host (tests/mcore_memory.py). Skips without megatron-core; returns mcore_cpu.

    The patches stay applied for the rest of the session (other test modules share the same
    process group and models); ``mcore_cpu.remove_cpu_patches()`` undoes the CPU ones.
    """
    import mcore_cpu

    if not mcore_cpu.HAVE_MCORE:
        pytest.skip(mcore_cpu.SKIP_REASON)
    import mcore_memory

    mcore_cpu.init_single_process()
    mcore_memory.patch_alltoall_dispatcher()
    return mcore_cpu


def pytest_collection_finish(session):
    """When real-framework tests are selected, build their venvs while the other tests run."""
    if any(item.get_closest_marker("frameworks") for item in session.items):
        from frameworks import envs

        envs.prebuild()
