"""The verdict of tests/test_megatron_unit_tests.py: a Megatron unit test counts as "needs more ranks" only by the
layout it asked initialize_model_parallel for (the plugin tests/megatron_plugins/megatron_world_size.py), never by
the message of its failure; every other failure is a failure."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest

from tests.test_megatron_unit_tests import RANKS_PLUGIN, megatron_pytest_env, verdict

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="t" name="passes"/>
<testcase classname="t" name="skips"><skipped message="Test requires world_size=2, but got 1"/></testcase>
<testcase classname="t" name="tp2"><properties><property name="needs_world_size" value="2"/></properties>
  <error message="megatron_world_size.NeedsMoreRanks: world_size (1) is not divisible by 2"/></testcase>
<testcase classname="t" name="says_divisible"><failure message="RuntimeError: 30 is not divisible by 4"/></testcase>
<testcase classname="t" name="says_world_size"><failure message="AssertionError: requires world_size 1"/></testcase>
</testsuite></testsuites>
"""


def test_a_failure_is_not_taken_for_a_missing_rank_by_its_message(tmp_path):
    report = tmp_path / "junit.xml"
    report.write_text(JUNIT)
    counts, failures = verdict(report)
    assert counts == {"passed": 1, "failed": 2, "skipped": 1, "needs more ranks": 1}
    assert [f.split(": ")[0] for f in failures] == ["t::says_divisible", "t::says_world_size"]
    counts, _ = verdict(report, world_size=2)  # a layout of 2 fits 2 ranks: its failure is a real one
    assert counts["needs more ranks"] == 0 and counts["failed"] == 3


MEGATRON_TESTS = '''
import pytest
import torch.distributed as dist
import megatron.core.parallel_state as ps


@pytest.fixture(scope="module", autouse=True)
def one_rank(tmp_path_factory):
    store = tmp_path_factory.mktemp("store") / "file"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class TestTensorParallel:
    def setup_method(self):  # Megatron's harness sets its layout up here
        ps.initialize_model_parallel(2, 1)

    def test_tp2(self):
        pass


def test_ep2():
    ps.initialize_model_parallel(expert_model_parallel_size=2)


def test_cp2_pp2():
    ps.initialize_model_parallel(pipeline_model_parallel_size=2, context_parallel_size=2)


def test_fits():
    ps.initialize_model_parallel(1, 1)
    ps.destroy_model_parallel()


def test_fits_then_fails_with_a_ranks_message():
    ps.initialize_model_parallel(1, 1)
    ps.destroy_model_parallel()
    raise RuntimeError("world_size (1) is not divisible by 2")


def test_fails_after_a_refused_layout_it_expected():
    with pytest.raises(RuntimeError, match="is not divisible by 2"):
        ps.initialize_model_parallel(2, 1)
    assert False, "a real failure"
'''


@pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None, reason="needs megatron-core")
def test_the_plugin_marks_exactly_the_tests_whose_layout_needs_more_ranks(tmp_path):
    """One rank, Megatron's real initialize_model_parallel: the layouts of 2 and 4 ranks (TP, EP, PP x CP) are
    marked, in setup or in the test; a test that fails for another reason is not, even with the same message or
    after catching a refused layout."""
    (tmp_path / "test_layouts.py").write_text(textwrap.dedent(MEGATRON_TESTS))
    report = tmp_path / "junit.xml"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", RANKS_PLUGIN, "-o", "addopts=", "-p", "no:cacheprovider", "-q",
         f"--junitxml={report}", "test_layouts.py"],
        cwd=tmp_path, env=megatron_pytest_env(), capture_output=True, text=True, timeout=600)
    assert report.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    counts, failures = verdict(report)
    assert counts == {"passed": 1, "failed": 2, "skipped": 0, "needs more ranks": 3}, run.stdout[-3000:]
    assert sorted(f.split(": ")[0] for f in failures) == [
        "test_layouts::test_fails_after_a_refused_layout_it_expected",
        "test_layouts::test_fits_then_fails_with_a_ranks_message"]
