import sys
from pathlib import Path

# Test helpers (mcore_cpu, mcore_dist) are plain modules beside the tests.
sys.path.insert(0, str(Path(__file__).parent))
