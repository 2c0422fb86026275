import sys
from pathlib import Path

# Test helpers (mcore_cpu, mcore_dist) are plain modules beside the tests.
sys.path.insert(0, str(Path(__file__).parent))


def pytest_collection_finish(session):
    """When real-framework tests are selected, build their venvs while the other tests run."""
    if any(item.get_closest_marker("frameworks") for item in session.items):
        from frameworks import envs

        envs.prebuild()
