from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _adanewton_test_env(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """ns_coefficients="adanewton" on shapes outside the shipped table would fit at run
    time (seconds each) and write to the user's cache. The suite uses a temporary cache
    and the nearest-table-entry mode; tests/test_adanewton*.py re-enable fitting where
    they test it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ROOTOPT_CACHE_DIR", str(tmp_path_factory.mktemp("rootopt-cache")))
        mp.setenv("ROOTOPT_ADANEWTON_FIT", "0")
        yield
