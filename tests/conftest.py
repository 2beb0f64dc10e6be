from __future__ import annotations

import fnmatch
import os
from pathlib import Path

import pytest
import torch

# The analysis package (analysis/rootopt_analysis: the benchmarks, the study, the coefficient
# fitter, the cost model and the byte counters some distributed tests measure with) is not
# part of the rootopt wheel. The tests use this checkout's copy: in this process through
# pyproject's `pythonpath`, in every process they start through PYTHONPATH (a test that sets
# its own PYTHONPATH names it too, or runs without it on purpose).
ANALYSIS = Path(__file__).resolve().parents[1] / "analysis"
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ANALYSIS), os.environ.get("PYTHONPATH", "")) if p
)

# The fast tier for the edit-test loop is `pytest -q -m "not e2e and not slow"`; the default
# `pytest -q` (CI) still runs these. A test is e2e when it launches processes (python, the CLI,
# torchrun, an inductor compile) or runs a job of its own for several seconds (a training run,
# a coefficient fit, a matrix beyond 2^24 entries). It is marked here, in one place, so that
# the tier follows one rule and not each file's habits: every test of a module in E2E_MODULES,
# and the named tests of E2E_TESTS (every parameter case of a name, or with ``name[glob]``
# the cases whose id matches the glob, e.g. ``test_x[compiled-*]``), picked from
# `pytest --durations=0`. docs/operations.md describes the tiers.
E2E_MODULES = frozenset(
    {
        "test_bench.py",  # the benchmark pipeline's --quick suite
        "test_dist_edge.py",  # gloo edge cases under torchrun
        "test_dist_backward.py",  # reduce-scatter in backward vs one process, under torchrun
        "test_dist_device.py",  # benchmarks/device_check.sh's dry mode (a subprocess)
        "test_dist_train.py",  # rootopt.train under torchrun
        "test_faults.py",  # real runs killed, starved of disk and data, resumed
        "test_parity.py",  # 100-step default runs under torchrun at world sizes 1, 2, 3
        "test_export_families.py",  # trains and exports a model of each architecture family
        "test_rl.py",  # a module fixture trains the PPO policy most tests use
        "test_user_path.py",  # the README's commands: rootopt train and torchrun, killed, rerun
    }
)
E2E_TESTS: dict[str, frozenset[str]] = {
    "test_provenance.py": frozenset(
        {"test_the_named_process_group_is_stopped_while_timing_and_continued_after"}
    ),
    "test_analysis_apart.py": frozenset(
        {
            "test_the_wheel_is_the_runtime_package_and_nothing_else",
            "test_the_analysis_package_installs_from_the_line_and_is_found",
            "test_import_rootopt_and_rootopt_train_run_without_the_analysis_package",
        }
    ),
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
    "test_docs_commands.py": frozenset({"test_documented_commands_run"}),
    "test_compile.py": frozenset(
        {"test_compiled_step_equals_eager_compiles_twice_and_checks_nonfinite"}
    ),
    "test_checkpointer.py": frozenset({"test_export_says_which_checkpoint_it_skipped_and_why"}),
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
    "test_bench_cli.py": frozenset(
        {
            "test_a_bench_refuses_an_existing_json_before_running",
            "test_bench_step_skip_bf16_times_float32_only_and_leaves_that_target_open",
        }
    ),
    "test_first_hour.py": frozenset(
        {
            "test_output_into_a_closed_pipe_ends_quietly",
            "test_a_training_run_into_a_closed_pipe_still_completes",
            "test_report_into_head_through_a_shell",
            "test_bench_help_without_the_train_extra_names_it",
            "test_bench_finished_only_reports_a_partial_suite_and_runs_nothing",
            "test_the_adanewton_snippet_runs_after_a_bare_import",
            "test_a_killed_rank_resumes_from_a_default_checkpoint",
            "test_ctrl_c_under_torchrun_is_torchrun_s_traceback_and_the_run_resumes",
        }
    ),
    "test_dist_deploy.py": frozenset({"test_launch_sh_trains_from_another_directory"}),
    "test_dist_owner.py": frozenset(
        {
            "test_owner_checkpoint_saved_at_two_loads_at_three",
            "test_owner_moves_adamw_bytes_in_a_constant_number_of_collectives",
        }
    ),
    "test_prepare.py": frozenset(
        {
            "test_sigkill_at_random_points_then_rerun_gives_the_same_data",
            "test_train_prepares_a_bpe_corpus_and_refuses_another_tokenizer",
        }
    ),
    "test_errors.py": frozenset(
        {
            "test_a_missing_peer_fails_within_the_rendezvous_timeout",
            "test_signal_before_the_first_step_says_so",
            "test_ctrl_c_while_importing_is_one_line",  # a python -c per case
        }
    ),
    "test_integrations_hf.py": frozenset({"test_import_rootopt_and_hf_do_not_import_transformers"}),
    "test_export.py": frozenset(
        {
            "test_sigkill_mid_export_leaves_no_out_dir",
            "test_the_embedded_default_run_exports_and_generates",
            "test_a_failed_write_names_the_file_and_publishes_nothing",
        }
    ),
    "test_inputs.py": frozenset(
        {  # a prepare or a run in a subprocess, paused or killed; a run, an export
            "test_a_second_prepare_into_one_out_is_refused_and_the_first_completes",
            "test_a_prepare_into_data_a_live_run_reads_is_refused",
            "test_the_start_up_cleanup_removes_every_temporary_a_write_of_the_run_leaves",
            "test_a_killed_prepare_is_taken_up_again_under_the_lock",
            "test_init_from_checks_the_tokenizer_and_says_where_it_started",
        }
    ),
    "test_hf_train.py": frozenset(
        {
            "test_world_sizes_1_2_ddp_and_fsdp_agree_then_export_and_init_from",
            "test_interrupted_hf_run_resumes_bit_identically",
            "test_init_from_starts_at_that_models_loss_and_trains_on",
            "test_bench_train_overhead_tiny_run_and_refusal",
        }
    ),
    "test_integrity.py": frozenset(
        {
            "test_a_link_anywhere_the_run_writes_is_refused_and_its_target_untouched",
            "test_stale_temporaries_that_are_links_are_removed_not_followed",
            "test_a_damaged_dcp_checkpoint_is_skipped_with_one_line_and_kept",
            "test_dcp_metadata_that_would_run_code_is_refused_at_world_size_2",
            "test_a_peer_killed_during_a_collective_save_leaves_one_line",
            "test_what_does_not_change_the_numbers_does_not_name_another_run",
            "test_a_new_default_directory_names_the_run_it_did_not_continue",
            "test_a_run_named_by_the_earlier_key_is_still_found",
            "test_sigint_while_the_command_starts_is_one_line",
            "test_a_complete_run_on_a_read_only_file_system_says_already_complete",
        }
    ),
    "test_monitor.py": frozenset({"test_report_and_diagnose_on_a_real_run"}),
    # the compiled step and the two-process paths (one torchrun launch serves them all);
    # every other path stays in the fast tier
    "test_paths.py": frozenset(
        {
            "test_path_matches_the_reference[compiled-*]",
            "test_path_matches_the_reference[dist2-*]",
            "test_path_matches_the_reference[avg2-*]",
            "test_path_matches_the_reference[sharded-*]",
        }
    ),
    "test_plan.py": frozenset(
        {
            "test_the_runtime_and_rootopt_train_never_import_the_cost_model",
            "test_cli_table_json_and_plot",
            "test_bench_dist_json_refuses_an_existing_file",
            "test_bench_dist_calibrate_refuses_zero_repeats",
        }
    ),
    "test_quantile.py": frozenset({"test_beyond_torch_quantile_limit"}),
    "test_resume_safety.py": frozenset(
        {
            "test_a_signal_during_the_final_evaluation",
            "test_last_good_checkpoint_survives_divergence_episodes_and_kills",
        }
    ),
    "test_rundir.py": frozenset(
        {
            "test_rerun_without_log_dir_resumes",
            "test_a_refused_launch_on_a_live_run_changes_nothing",
        }
    ),
    "test_study.py": frozenset({"test_quick_study_runs_decides_resumes_and_renders"}),
    "test_train.py": frozenset(
        {
            "test_killed_process_restarts_bit_identically",
            "test_sigterm_checkpoints_then_exits",
            "test_interrupted_then_resumed_equals_uninterrupted",
        }
    ),
}


# Tests that guard only the analysis package (the study and benchmark pipelines, the
# coefficient fitter and its spectra, the cost model) and cost seconds run in the slow tier
# (`pytest -m slow`): the runtime's own tests stay in the default suite, and
# tests/test_analysis_apart.py keeps the analysis commands' routing there too.
ANALYSIS_SLOW: dict[str, frozenset[str]] = {
    "test_adanewton_fit.py": frozenset(
        {
            "test_spectra_deterministic_and_seeded",
            "test_rescaled_large_shape_matches_marchenko_pastur_edge",
            "test_fit_respects_constraints_and_beats_published",
            "test_single_mode_is_a_repeated_stable_tuple",
            "test_fit_is_reproducible_from_its_provenance",
            "test_shipped_entry_reproducible_from_table_provenance",
            "test_bfloat16_fit_runs_and_passes_the_runtime_certificate",
            "test_cli_bench_small",
        }
    ),
    "test_bench.py": frozenset(
        {
            "test_quick_suite_runs_every_optimizer_on_every_task_and_resumes",
            "test_a_blown_up_run_is_recorded_as_diverged",
        }
    ),
    "test_first_hour.py": frozenset(
        {"test_bench_finished_only_reports_a_partial_suite_and_runs_nothing"}
    ),
    "test_heldout.py": frozenset({"test_record_task_digits_default_path"}),
    "test_hf_train.py": frozenset({"test_bench_train_overhead_tiny_run_and_refusal"}),
    "test_plan.py": frozenset(
        {
            "test_owner_bytes_target_on_llama_shapes",
            "test_imbalance_target_or_critical_path_at_the_bound",
            "test_step_time_and_verdict_state_their_assumptions",
            "test_cli_table_json_and_plot",
        }
    ),
    "test_study.py": frozenset(
        {
            "test_quick_study_runs_decides_resumes_and_renders",
            "test_selection_runs_evaluate_only_at_the_end_with_the_same_losses",
            "test_publish_rewrites_only_the_generated_blocks",
        }
    ),
}


# Cases that repeat, at another size or option, a path a default-suite test already covers run
# in the slow tier too, so that `pytest -q` stays within 12 minutes on 2 cores
# (docs/operations.md). Each line names what keeps the path in the default suite.
REPEATS_SLOW: dict[str, frozenset[str]] = {
    # resharding and uneven rows: test_dist.py::test_checkpoint_reshards_across_world_sizes,
    # test_dist_owner.py (two -> three), test_two_ranks_one_and_three_rows
    "test_dist_edge.py": frozenset(
        {
            "test_four_ranks_five_two_and_fifteen_rows",
            "test_eight_ranks_eighteen_rows",
            "test_checkpoint_saved_at_four_loads_at_three",
        }
    ),
    # a rank that hangs: test_dist_train.py::test_hung_rank_is_stopped_by_the_collective_timeout
    "test_dist.py": frozenset({"test_hung_rank_stops_with_one_line"}),
    # the benchmark script's arms (the sync modes themselves: test_dist_backward's parity tests)
    "test_dist_backward.py": frozenset(
        {"test_bench_backward_sync_runs_every_arm_and_refuses_nonsense"}
    ),
    # kills of a prepare: the [bytes] case; bpe preparing: test_bits_per_byte, test_inputs
    "test_prepare.py": frozenset(
        {"test_sigkill_at_random_points_then_rerun_gives_the_same_data[bpe*]"}
    ),
    # compiled against the reference: compiled-default and the other option sets
    "test_paths.py": frozenset({"test_path_matches_the_reference[compiled-bf16_params]"}),
    # world-size parity: the default case (accum1) at world sizes 2 and 3, bfloat16
    # iterations at 2; accumulation under no_sync across ranks: test_dist_backward.py
    "test_parity.py": frozenset(
        {
            "test_default_run_logs_the_same_losses_at_world_size[accum2-*]",
            "test_default_run_logs_the_same_losses_at_world_size[bf16-3]",
        }
    ),
    # a killed process resumes bit-identically: test_faults.py's SIGKILLs at random points
    "test_train.py": frozenset({"test_killed_process_restarts_bit_identically"}),
    # Ctrl-C and rerun in one process, and a rank killed under torchrun and resumed:
    # test_user_path.py
    "test_first_hour.py": frozenset(
        {"test_ctrl_c_under_torchrun_is_torchrun_s_traceback_and_the_run_resumes"}
    ),
}


def _entry(entry: str) -> tuple[str, str]:
    """``"name"`` -> (name, "*"); ``"name[glob]"`` -> (name, glob on the case id)."""
    name, bracket, rest = entry.partition("[")
    return name, (rest[:-1] if bracket and rest.endswith("]") else "*")


def _named(table: dict[str, frozenset[str]], module: str, name: str, case: str) -> bool:
    return any(
        name == n and fnmatch.fnmatchcase(case, glob)
        for n, glob in map(_entry, table.get(module, ()))
    )


def _is_e2e(module: str, name: str, case: str) -> bool:
    return module in E2E_MODULES or _named(E2E_TESTS, module, name, case)


@pytest.hookimpl(tryfirst=True)  # before `-m` selects on the markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    modules: dict[str, object] = {}
    for item in items:
        module = Path(str(item.path)).name
        name = getattr(item, "originalname", item.name)
        callspec = getattr(item, "callspec", None)
        case = callspec.id if callspec is not None else ""
        if _is_e2e(module, name, case):
            item.add_marker(pytest.mark.e2e)
        if _named(ANALYSIS_SLOW, module, name, case) or _named(REPEATS_SLOW, module, name, case):
            item.add_marker(pytest.mark.slow)
        if isinstance(item, pytest.Function):
            modules[module] = item.module
    # A renamed or deleted test must not drop silently out of the tier.
    tables = (
        (E2E_TESTS, "E2E_TESTS"),
        (ANALYSIS_SLOW, "ANALYSIS_SLOW"),
        (REPEATS_SLOW, "REPEATS_SLOW"),
    )
    for table, label in tables:
        for module, names in table.items():
            if module in modules:
                missing = sorted(n for n in names if not hasattr(modules[module], _entry(n)[0]))
                if missing:
                    raise pytest.UsageError(
                        f"tests/conftest.py {label} names no test {module}::{missing}"
                    )


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _adanewton_test_env(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A test that fits (``ns_fit=True``, ``rootopt coeffs fit --cache``) writes to a
    temporary cache, never the user's (nothing fits unless asked: docs/adanewton.md)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ROOTOPT_CACHE_DIR", str(tmp_path_factory.mktemp("rootopt-cache")))
        yield
