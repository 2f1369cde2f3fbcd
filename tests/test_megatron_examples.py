"""Real models as tests: Megatron-LM's own example launch scripts (Llama 3 8B FP8, Mixtral 8x7B, GPT-3 175B) and
real model shapes (DeepSeek-V3 from Megatron's recipe, Qwen3 8B and 30B-A3B from its model configs), each with its
flags as written apart from sizes, data, paths and parallel sizes (tests/megatron_examples.py: OVERRIDABLE),
trained for a few iterations by `python -m mindspeed_te.launch <tree>/pretrain_gpt.py` on 2 CPU processes.

MEGATRON_LM_TREES names the Megatron-LM source trees (several separated by os.pathsep); each case runs on each
tree, with that tree on PYTHONPATH. A case is skipped on a tree whose release lacks its script or a flag or feature
it needs (read from the tree's files and from the flags its pretrain_gpt.py parses). The training runs are slow;
the checks of the commands only run the scripts under bash (tests/megatron_examples.py: script_flags).
"""
from __future__ import annotations

import math
import re

import pytest

from tests import megatron_examples as examples
from tests import megatron_matrix

TREES = examples.trees()
pytestmark = pytest.mark.skipif(not TREES, reason="needs MEGATRON_LM_TREES: one or more Megatron-LM source trees "
                                                   "(separated by os.pathsep)")


def _params(cases):
    if not TREES:
        return [pytest.param(None, None, id="no-tree")]
    return [pytest.param(tree, case, id=f"{examples.tree_id(tree)}-{case.id}") for tree in TREES for case in cases]


def _skip_unless_runnable(tree, case):
    why = examples.missing(case, tree)
    if why:
        pytest.skip(why)


@pytest.mark.parametrize("tree, case", _params(examples.CASES))
def test_the_scripts_flags_reach_pretrain_gpt_unchanged(tree, case, tmp_path):
    """Every flag of the script (with its values) is in the command, unless OVERRIDABLE (or one of the case's
    few documented changes) lets it change; the sizes that change do shrink; data comes from --mock-data."""
    _skip_unless_runnable(tree, case)
    script, command, _ = examples.prepare(case, tree, str(tmp_path))
    assert examples.kept_flags(case, script, command) == []
    have = dict(examples.groups(command))
    assert have["--mock-data"] == () and have["--tokenizer-type"] == ("NullTokenizer",)
    assert not {"--data-path", "--tokenizer-model", "--vocab-file", "--merge-file"} & set(have)
    for flag in ("--num-layers", "--hidden-size", "--seq-length", "--global-batch-size"):
        assert int(have[flag][0]) <= 64, (flag, have[flag])
    world = 1
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size"):
        world *= int(have.get(flag, ("1",))[0])
    assert 2 % world == 0
    assert not any(str(tree) in word for word in command if "pretrain_gpt.py" not in word)  # nothing written there


def test_the_deepseek_v3_flags_are_megatrons_recipe(tmp_path):
    """The DeepSeek-V3 flags kept in tests/megatron_examples.py are, flag for flag, the PRETRAIN_ARGS of
    Megatron's recipe in every tree that has it."""
    recipe = examples.DEEPSEEK_V3_RECIPE
    with_recipe = [tree for tree in TREES if examples.missing(recipe, tree) is None]
    if not with_recipe:
        pytest.skip(f"no tree of MEGATRON_LM_TREES has {recipe.script}")
    for tree in with_recipe:
        flags, _ = examples.script_flags(recipe, tree, str(tmp_path))
        assert examples.groups(flags) == examples.groups(list(examples.DEEPSEEK_V3)), tree


@pytest.mark.slow
@pytest.mark.parametrize("tree, case", _params(examples.CASES))
def test_megatron_example_trains_to_finite_losses(tree, case, tmp_path):
    """The shrunk model trains on 2 processes: every iteration logs finite losses (fp16's loss-scale search logs
    none for the iterations it skips), no NaN iteration, and the script's end (its checkpoint save, evaluation)
    completes."""
    _skip_unless_runnable(tree, case)
    script, command, exported = examples.prepare(case, tree, str(tmp_path), examples.accepted_flags(tree))
    assert examples.kept_flags(case, script, command) == []
    unknown = examples.unaccepted(command, tree)
    if unknown:
        pytest.skip(f"this release's pretrain_gpt.py takes no {', '.join(unknown)}")
    megatron_matrix.build_dataset_helpers(tree)
    run = examples.launch(case, tree, str(tmp_path), command, exported)
    tail = "\n".join(run.output.splitlines()[-40:])
    if run.returncode != 0:
        pytest.fail(run.failure(), pytrace=False)
    losses = run.losses()
    iterations = int(re.search(r"iteration\s+\d+/\s*(\d+) \|", run.output).group(1))
    assert len(losses) >= 3 and iterations in losses, (sorted(losses), tail)  # fp16 skips its first iterations
    assert all("lm loss" in line for line in losses.values()), losses
    assert all(math.isfinite(v) for line in losses.values() for v in line.values()), losses
    nan_iterations = re.findall(r"iteration\s+\d+/.*\| number of nan iterations:\s+(\d+) \|", run.output)
    assert len(nan_iterations) == iterations and set(nan_iterations) == {"0"}, tail
