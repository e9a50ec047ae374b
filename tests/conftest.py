import os
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# profiles a test triggers go to a scratch directory, never the user's cache
os.environ["SPECDEC_CACHE_DIR"] = tempfile.mkdtemp(prefix="specdec-test-cache-")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def pytest_sessionstart(session):
    """Unpack the bundled pair's weights into the scratch cache once, quietly, before any test captures stderr."""
    from specdec_ext.zoo import PAIR_DIR, pair_available
    from specdec_ext.zoo.store import pair_dir

    if pair_available():
        pair_dir(PAIR_DIR, log=lambda message: None)
