"""Shared fixtures of tests/test_book.py and tests/test_browser.py (the offline book build), and the `slow` marks.

`make check` runs ``pytest tests -m "not slow"``; `make test` runs everything. What is slow is decided here, in
one place, so that test files need no marks of their own (see ``pytest_collection_modifyitems``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import _scheduling
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
JUPYTER_BOOK = Path(sys.executable).with_name("jupyter-book")
BUILD_TIMEOUT_S = 900
ANSI = re.compile(r"\x1b\[[0-9;]*m")
PROBLEM = re.compile(r"WARNING|ERROR|SEVERE|CRITICAL|Exception|Traceback|Error:")

# Every distributed test runs under NCCL's rules (scalebook.comm.nccl_rules): launch() and init_from_env() (the CLI
# under torchrun) read this variable, set at import time so that every rank and subprocess inherits it.
os.environ.setdefault("SCALEBOOK_CHECK_NCCL", "1")


def toc_files() -> list[str]:
    """Every ``file:`` entry of _toc.yml (the root first), in order, as written (no suffix)."""
    toc = yaml.safe_load((REPO / "_toc.yml").read_text(encoding="utf8"))
    files: list[str] = [toc["root"]]

    def walk(node):
        if isinstance(node, dict):
            if "file" in node:
                files.append(node["file"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk({key: value for key, value in toc.items() if key != "root"})
    return list(dict.fromkeys(files))


def toc_pages() -> list[str]:
    """The built page (path of the .html file) of every entry of _toc.yml, in order."""
    return [str(Path(f).with_suffix("")) + ".html" for f in toc_files()]


def _build_book(src: Path, out: Path, config_overrides: dict | None = None) -> Path:
    """Build the Jupyter Book in ``src`` from the notebooks' committed outputs, into ``out``.

    Execution is switched off through a copy of ``src/_config.yml`` (plus ``config_overrides``,
    merged at the top level and into ``sphinx.config``), warnings are errors, and the test fails
    with the build log if the build does. Returns the ``_build/html`` folder.
    """
    config = yaml.safe_load((src / "_config.yml").read_text(encoding="utf8"))
    config.setdefault("execute", {})["execute_notebooks"] = "off"
    overrides = dict(config_overrides or {})
    sphinx_overrides = overrides.pop("sphinx_config", {})
    config.update(overrides)
    config.setdefault("sphinx", {}).setdefault("config", {}).update(sphinx_overrides)
    # Jupyter Book resolves local extension paths against the config file's folder, which is `out`.
    local = config["sphinx"].get("local_extensions") or {}
    config["sphinx"]["local_extensions"] = {name: str((src / path).resolve()) for name, path in local.items()}
    out.mkdir(parents=True, exist_ok=True)
    config_path = out / "_config.offline.yml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf8")

    cmd = [
        str(JUPYTER_BOOK),
        "build",
        str(src),
        "--config",
        str(config_path),
        "--path-output",
        str(out),
        "-W",
        "-n",
        "--keep-going",
    ]
    env = dict(os.environ, PYDEVD_DISABLE_FILE_VALIDATION="1", MPLBACKEND="Agg")
    started = time.monotonic()
    proc = subprocess.run(
        cmd, cwd=src, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=BUILD_TIMEOUT_S
    )
    elapsed = time.monotonic() - started
    log_path = out / "build.log"
    log_path.write_text(proc.stdout, encoding="utf8")
    html = out / "_build" / "html"
    if proc.returncode != 0 or not (html / "index.html").is_file():
        lines = [ANSI.sub("", line) for line in proc.stdout.splitlines()]
        problems = [line for line in lines if PROBLEM.search(line)]
        pytest.fail(
            f"jupyter-book build failed (exit {proc.returncode}, {elapsed:.1f} s): "
            f"{' '.join(cmd)}\n--- warnings and errors ---\n"
            + "\n".join(problems[:60])
            + "\n--- end of the log ---\n"
            + "\n".join(lines[-15:])
            + f"\n(full log: {log_path})",
            pytrace=False,
        )
    print(f"\n[book] built {src.name} in {elapsed:.1f} s -> {html}")
    return html


# Fixtures whose tests are slow wherever they are used: the book build (30 s to minutes) and the real
# two-node SLURM cluster (about 15 s up and down, 10-20 s a job).
SLOW_FIXTURES = {"book_html", "build_book", "cluster"}

# Measured with `pytest tests --durations=0 -p no:cacheprovider` on the 2-core machine (2026-11-25, loaded by
# other jobs, load average ~6): each name here took 5 s or more there (setup + call), against a median test of
# under 0.05 s; then `pytest tests -m "not slow" --durations=60` after the suites were rewritten (load ~12, so
# 10 s) added the waits for timeouts of test_labs. What stays in `make check` launches at most 3 ranks.
# A name is a test function, a fixture its tests use (a launch shared by a module's tests is paid once, by
# whichever of them runs first), or `fixture[param]` for one instance of a parametrized fixture.
SLOW = {
    # runs of the training command line: a subprocess (under torchrun, 2-4 ranks) for each test that gets a
    # tmp_path, or launches training every layout for 6 steps and resuming it: 5-30 s each
    "test_cli.py": {"tmp_path"},
    "test_cli_strategies.py": {"single", "wrappers", "dimensions", "four_ranks"},
    # the Trainer under torchrun and under accelerate launch (the `launched` fixture), an accelerate launch
    "test_hf_train.py": {
        "test_trainer_trains_our_gpt_with_ddp_on_two_ranks",
        "launched",
        "test_accelerate_on_cpu_without_mpirun_starts_one_process",
    },
    # launches of 4 or 8 ranks, waits for a timeout, or many training steps
    "test_collectives.py": {"reports"},
    "test_context_parallel.py": {"launched[4]"},
    "test_ddp.py": {"ranks[4]"},
    # an older torch emulated in a launch of its own (21 s in `make check`, 2026-11-28)
    "test_device_generic.py": {"four_ranks", "test_an_older_torch_gets_the_collectives_new_names"},
    "test_expert_parallel.py": {"launched[4]"},
    "test_hsdp.py": {"hsdp"},  # 4 ranks (2 nodes of 2): our HSDP and FSDP2's in fp64 and fp32 (issue 24)
    "test_labs.py": {
        "test_mismatched_collectives_surface_within_the_timeout_and_leave_no_process",
        "test_distributed_debug_detail_names_the_mismatch_at_once",
        # a 3-rank launch of the slow-rank lab (issue 24)
        "test_step_times_and_flight_recorder_name_the_slow_rank_and_find_none_without_it",
    },
    "test_launch.py": {
        "test_a_silent_hang_is_killed_after_the_timeout",
        "test_a_rank_missing_from_a_collective_times_out_and_is_named",
    },
    "test_mesh.py": {"test_dp2_tp2_pp2_on_8_ranks_trains_like_one_process"},
    # torchrun's ranks killed after a 20 s timeout; Ctrl-C delivered to torchrun's two ranks (issues 32, 37)
    "test_processes.py": {"test_torchrun_ranks_already_running_are_killed_on_timeout"},
    "test_cli_input.py": {
        "test_under_torchrun_a_ctrl_c_stops_every_rank_without_a_traceback",
        # torchrun started by hand on a refused layout; torchrun as the sbatch scripts run it, stopped (issue 37)
        "test_a_refused_layout_under_a_torchrun_started_by_hand_is_one_message_and_exit_code_2_from_every_rank",
        "test_torchrun_as_the_sbatch_scripts_run_it_passes_a_stop_on_and_ends_without_a_traceback",
        # torchrun with a rank 0 that is 3 s late to an error rank 1 finds at once
        "test_an_error_every_rank_finds_is_said_by_rank_0_even_when_another_rank_finds_it_first",
    },
    "test_pipeline.py": {
        "test_four_stages_match_unpartitioned_model_and_torch_pipelining",
        "test_two_stages_match_unpartitioned_model_and_torch_pipelining",
        "test_checkpointed_stages_give_the_same_loss_and_gradients_and_save_what_the_formula_says",
    },
    "test_planner.py": {"llama_plan"},
    "test_profiling.py": {"traces"},  # a 2-rank launch that profiles two steps (issue 24)
    # 2-rank stops and a signalled subprocess (issue 21); spawned prepare workers; a 4-rank ZeRO-3 checkpoint
    # resumed in five layouts (every test of the file uses its `zero3` fixture)
    "test_preemption.py": {
        "test_two_ranks_agree_to_stop_when_only_one_is_signalled_and_resume_bit_for_bit",
        "test_the_command_stops_on_sigterm_with_its_exit_code_and_says_that_without_a_checkpoint_all_is_lost",
    },
    "test_prepare.py": {
        "test_bytes_prepare_in_two_workers_gives_read_corpus_tokens_split_like_train_val_split",
        "test_workers_that_cannot_start_raise_instead_of_hanging",
    },
    "test_reshard.py": {"zero3"},
    "test_tensor_parallel.py": {"measured"},
    "test_parameter_server.py": {"launched[2]", "launched[3]"},  # launches of seven training runs (issue 24)
    # Each 9-14 s in `make check` on 2026-11-28 (over its 3 minutes): a launch per wrapper with a NaN gradient, the
    # stop that every rank agrees on, a missing average found by gradient norms, a notebook executed in a kernel
    # and a launch whose head-to-head sends gloo completes (issue 32)
    "test_reliability.py": {
        "test_every_wrapper_skips_a_nan_gradient_and_trains_on_as_one_process",
        "test_every_rank_skips_and_stops_at_the_same_step_so_none_hangs",
        "test_the_ranks_of_a_launch_read_the_checkpoint_files_once_in_all_and_fall_back_together",  # 2 ranks
        "test_a_damaged_manifest_on_the_ranks_of_a_launch_falls_back_like_a_damaged_file",  # 2 ranks
    },
    "test_parity.py": {"test_gradient_norms_catch_the_missing_average_that_the_losses_hide"},
    "test_notebook_helpers.py": {
        "test_execute_notebook_runs_saves_outputs_and_stores_each_eval_result_where_its_cell_stands"
    },
    "test_nccl_rules.py": {"test_launch_fails_head_to_head_sends_that_gloo_completes"},
    "test_ulysses.py": {"launched[4]"},
    "test_traffic.py": {"recorded"},
    "test_train.py": {"test_loss_falls_on_the_embedded_corpus", "test_bf16_autocast_trains_close_to_fp32"},
    # 2-rank launches (issue 34, 6-15 s each under load): ZeRO-1 saving and resuming, the elementwise refusals,
    # the split checkpoint verification, torch DDP's loops against the book's DDP
    "test_state_dict.py": {"zero1"},
    "test_elementwise.py": {"ranks"},
    "test_checkpoint_verify.py": {"ranks"},
    "test_ddp_torch_shape.py": {"results"},
}


def _slow_names(item) -> set[str]:
    """The names ``SLOW`` can match for ``item``: its function, its fixtures, and ``fixture[param]``."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    fixtures = set(getattr(item, "fixturenames", ()))
    return {item.originalname, *fixtures, *(f"{name}[{params[name]}]" for name in fixtures & set(params))}


# `make test` runs two pytest-xdist workers. Tests go to the workers in groups (GroupScheduling): a notebook's
# cells run in order in one kernel, a module's shared launch (a module-scoped fixture) runs once, every user of
# the built book (a session fixture, built once per worker) shares one worker, and the local SLURM clusters of
# test_slurm.py and Chapter 15 never start at the same time. (pytest-xdist's own --dist loadgroup cannot do it
# under pytest 9: it renames items through Item._nodeid, which pytest 9 no longer reads.)
BOOK_USERS = {
    "test_book.py", "test_browser.py", "test_chapters.py", "test_live_calculators.py", "test_reader_aids.py",
    "test_publish.py", "test_site.py",
}
SLURM_USERS = {"test_slurm.py", "15_on_a_real_cluster.ipynb"}
# Chapter 5 trains the very run Chapter 1 trains and keeps (scalebook.train.reuse): on one worker, Chapter 1 first,
# it loads that run instead of training it again.
TINY_GPT_RUN = {"01_why_train_at_scale.ipynb", "05_language_model.ipynb"}
# Per-item limits (pytest-timeout; the default is pyproject.toml's `timeout`): a test that hangs fails with its
# name instead of eating CI's time. The first user of the book pays for building it (minutes on two cores).
BOOK_TIMEOUT_S = 1800


def xdist_group(nodeid: str) -> str:
    """The group of the test ``nodeid``: its file, or "book", "slurm" or "tiny-gpt" for the files that share those."""
    path = nodeid.split("::", 1)[0]
    name = path.rsplit("/", 1)[-1]
    shared = {"book": BOOK_USERS, "slurm": SLURM_USERS, "tiny-gpt": TINY_GPT_RUN}
    return next((group for group, names in shared.items() if name in names), path)


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope`` with :func:`xdist_group` as the scope (each group runs on one worker, in order),
    the longest groups first (tests/_scheduling.py)."""
    if config.getvalue("dist") != "loadscope":
        return None
    return _scheduling.make_scheduler(config, log, xdist_group)


def pytest_configure(config):
    """One torch thread per xdist worker; with SCALEBOOK_GROUP_DURATIONS=path, the controller writes each
    group's measured seconds there (`make test-durations` refreshes tests/group_durations.json)."""
    _scheduling.one_thread_per_worker()
    out = os.environ.get("SCALEBOOK_GROUP_DURATIONS")
    if out and not os.environ.get("PYTEST_XDIST_WORKER"):
        config.pluginmanager.register(_scheduling.DurationRecorder(Path(out), xdist_group), "group-durations")


def pytest_collection_modifyitems(config, items):
    """Mark slow: the notebooks (nbval), browser tests, users of SLOW_FIXTURES and what SLOW names; give the
    book's users their longer timeout."""
    for item in items:
        if item.path.name in BOOK_USERS:
            item.add_marker(pytest.mark.timeout(BOOK_TIMEOUT_S))
    for item in items:
        is_test_function = isinstance(item, pytest.Function)
        slow = (
            not is_test_function
            or item.get_closest_marker("browser") is not None
            or bool(SLOW_FIXTURES & set(item.fixturenames))
            or bool(SLOW.get(item.path.name, set()) & _slow_names(item))
        )
        if slow:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def book_html(tmp_path_factory) -> Path:
    """The book, built once per session from the committed notebook outputs (no execution).

    Set BOOK_HTML_DIR to an already built site (e.g. ``_build/html`` after ``make book``) to test
    that instead of building.
    """
    existing = os.environ.get("BOOK_HTML_DIR")
    if existing:
        html = Path(existing).resolve()
        assert (html / "index.html").is_file(), f"BOOK_HTML_DIR={existing} holds no built book"
        return html
    return _build_book(REPO, tmp_path_factory.mktemp("book"))


@pytest.fixture(scope="session")
def build_book():
    """``build_book(src, out, config_overrides=None) -> html folder``, for extra test books."""
    return _build_book
