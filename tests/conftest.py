import os
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
# profiles a test triggers go to a scratch directory, never the user's cache. Under pytest-xdist each worker has
# its own, and the weights the controller unpacked into its directory (while the workers start; they wait for them)
# (SPECDEC_TEST_SHARED_CACHE, inherited) are linked into it, so they are made once a run, not once a worker
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
os.environ["SPECDEC_CACHE_DIR"] = tempfile.mkdtemp(prefix="specdec-test-cache-")
if not WORKER:
    os.environ["SPECDEC_TEST_SHARED_CACHE"] = os.environ["SPECDEC_CACHE_DIR"]
# serial: torch at two threads (these machines have two cores); under pytest-xdist (PYTEST_XDIST_WORKER set) each
# worker takes one, so two workers share two cores without oversubscribing them
torch.set_num_threads(1 if WORKER else max(1, min(2, os.cpu_count() or 1)))
# torch reads ATEN_CPU_CAPABILITY once, at its first kernel dispatch: read it now, so that the tests that set it to
# avx2 (our ops read it at each call: the baseline kernels) do not fix torch's own kernels to AVX2 for the rest of a
# worker (bfloat16 SDPA then refuses to run) when they happen to run first
torch.backends.cpu.get_cpu_capability()

UNPACKED = ".unpacked"  # in the shared scratch cache: the controller's unpacking ended ("ok" or its error)


def _unpack_bundled_pair(shared: str) -> None:
    from specdec_ext.zoo import PAIR_DIR, pair_available
    from specdec_ext.zoo.store import pair_dir

    try:
        if pair_available():
            pair_dir(PAIR_DIR, log=lambda message: None)
        status = "ok"
    except Exception as e:  # the workers go on without it; a test that loads the pair then meets the error
        status = f"{type(e).__name__}: {e}"
    with open(os.path.join(shared, UNPACKED), "w") as f:
        f.write(status)


def pytest_sessionstart(session):
    """Unpack the bundled pair's weights into the scratch cache once, quietly, before any test captures stderr (the
    real pair's GGUF file is converted by tests/test_real_pair.py, the one module that reads it). Under pytest-xdist
    the controller unpacks in a thread while the workers start (lzma and sha256 let go of the GIL), and each worker
    waits for it before linking what it made."""
    shared = os.environ.get("SPECDEC_TEST_SHARED_CACHE")
    if WORKER:
        if shared and os.path.isdir(shared):
            done = os.path.join(shared, UNPACKED)
            deadline = time.monotonic() + 600
            while not os.path.exists(done) and time.monotonic() < deadline:
                time.sleep(0.05)
            for entry in os.listdir(shared):
                if entry != UNPACKED:
                    os.symlink(os.path.join(shared, entry), os.path.join(os.environ["SPECDEC_CACHE_DIR"], entry))
    elif session.config.pluginmanager.has_plugin("dsession"):  # pytest-xdist's controller: workers run the tests
        threading.Thread(target=_unpack_bundled_pair, args=(shared,), daemon=True).start()
    else:
        _unpack_bundled_pair(shared)
