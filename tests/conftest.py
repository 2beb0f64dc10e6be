from __future__ import annotations

from pathlib import Path

import pytest
import torch

# The fast tier for the edit-test loop is `pytest -q -m "not e2e and not slow"`; the default
# `pytest -q` (CI) still runs these. A test is e2e when it launches processes (python, the CLI,
# torchrun, an inductor compile) or runs a job of its own for several seconds (a training run,
# a coefficient fit, a matrix beyond 2^24 entries). It is marked here, in one place, so that
# the tier follows one rule and not each file's habits: every test of a module in E2E_MODULES,
# and the named tests of E2E_TESTS (every parameter case of a name), picked from
# `pytest --durations=0`. docs/operations.md describes the tiers.
E2E_MODULES = frozenset(
    {
        "test_bench.py",  # the benchmark pipeline's --quick suite
        "test_dist_edge.py",  # gloo edge cases under torchrun
        "test_dist_train.py",  # rootopt.train under torchrun
        "test_faults.py",  # real runs killed, starved of disk and data, resumed
        "test_parity.py",  # 100-step default runs under torchrun at world sizes 1, 2, 3
        "test_rl.py",  # a module fixture trains the PPO policy most tests use
    }
)
E2E_TESTS: dict[str, frozenset[str]] = {
    "test_adanewton.py": frozenset(
        {
            "test_import_and_default_construction_do_not_import_tools_or_scipy",
            "test_two_processes_resolve_identical_schedules",
            "test_file_lock_serialises_concurrent_fits",
            "test_families_unseen_shapes_meet_target_fast",
        }
    ),
    "test_adanewton_fit.py": frozenset(
        {
            "test_fit_is_reproducible_from_its_provenance",
            "test_shipped_entry_reproducible_from_table_provenance",
            "test_bfloat16_fit_runs_and_passes_the_runtime_certificate",
            "test_cli_bench_small",
        }
    ),
    "test_anneal.py": frozenset({"test_cli_check_and_bad_inputs"}),
    "test_compile.py": frozenset(
        {"test_compiled_step_equals_eager_compiles_twice_and_checks_nonfinite"}
    ),
    "test_contract.py": frozenset({"test_resume_in_fresh_process", "test_loss_decreases"}),
    "test_dist.py": frozenset(
        {
            "test_three_ranks_uneven_match_single_process",
            "test_checkpoint_reshards_across_world_sizes",
            "test_two_node_launch_on_localhost",
            "test_hung_rank_stops_with_one_line",
            "test_finish_keeps_the_exit_code_and_flushes_output",
        }
    ),
    "test_dist_deploy.py": frozenset({"test_launch_sh_trains_from_another_directory"}),
    "test_integrations_hf.py": frozenset({"test_import_rootopt_and_hf_do_not_import_transformers"}),
    "test_monitor.py": frozenset({"test_report_and_diagnose_on_a_real_run"}),
    "test_plan.py": frozenset({"test_cli_table_json_and_plot"}),
    "test_quantile.py": frozenset({"test_beyond_torch_quantile_limit"}),
    "test_train.py": frozenset(
        {
            "test_killed_process_restarts_bit_identically",
            "test_sigterm_checkpoints_then_exits",
            "test_interrupted_then_resumed_equals_uninterrupted",
        }
    ),
}


@pytest.hookimpl(tryfirst=True)  # before `-m` selects on the markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    modules: dict[str, object] = {}
    for item in items:
        module = Path(str(item.path)).name
        name = getattr(item, "originalname", item.name)
        if module in E2E_MODULES or name in E2E_TESTS.get(module, ()):
            item.add_marker(pytest.mark.e2e)
        if isinstance(item, pytest.Function):
            modules[module] = item.module
    # A renamed or deleted test must not drop silently out of the tier.
    for module, names in E2E_TESTS.items():
        if module in modules:
            missing = sorted(n for n in names if not hasattr(modules[module], n))
            if missing:
                raise pytest.UsageError(
                    f"tests/conftest.py E2E_TESTS names no test {module}::{missing}"
                )


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
