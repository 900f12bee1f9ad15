"""Lightning integration tests: tiny models run fastest on one thread (and do not fight parallel jobs)."""

import warnings

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")  # module scope: also covers the module-scoped fp32 references
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*litlogger.*")
        yield
    torch.set_num_threads(threads)
