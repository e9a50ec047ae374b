import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
