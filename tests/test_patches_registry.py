"""The patch registry on throw-away modules: replacement, rebinding of importers, flags, revert, errors."""
from __future__ import annotations

import re
import sys
import types

import pytest

from mindspeed_te.patches.registry import PatchError, PatchRegistry


class Original:
    pass


class Replacement:
    pass


def original_helper() -> str:
    return "original"


@pytest.fixture
def fake_modules():
    """fakepkg.defs defines the targets; fakepkg.user imported them by name; other.user is outside the prefix."""
    defs = types.ModuleType("fakepkg.defs")
    defs.Thing, defs.helper, defs.HAVE_X, defs.other_flag = Original, original_helper, False, False
    user = types.ModuleType("fakepkg.user")
    user.Thing, user.helper, user.HAVE_X, user.unrelated_false = Original, original_helper, False, False
    outside = types.ModuleType("other.user")
    outside.Thing = Original
    modules = {"fakepkg": types.ModuleType("fakepkg"), "fakepkg.defs": defs, "fakepkg.user": user,
               "other.user": outside}
    sys.modules.update(modules)
    yield defs, user, outside
    for name in modules:
        sys.modules.pop(name, None)


def test_apply_replaces_and_rebinds_importers_under_the_prefix(fake_modules):
    defs, user, outside = fake_modules
    registry = PatchRegistry(rebind_prefixes=("fakepkg",))
    registry.register("fakepkg.defs.Thing", Replacement)
    registry.register("fakepkg.defs.helper", len)
    registry.apply()
    assert defs.Thing is Replacement and user.Thing is Replacement
    assert defs.helper is len and user.helper is len
    assert outside.Thing is Original  # not under the rebind prefixes


def test_plain_values_are_patched_only_where_registered(fake_modules):
    defs, user, _ = fake_modules
    registry = PatchRegistry(rebind_prefixes=("fakepkg",))
    registry.register("fakepkg.user.HAVE_X", True)
    registry.register("fakepkg.user.NEW_NAME", Replacement, create=True)
    registry.apply()
    assert user.HAVE_X is True and user.NEW_NAME is Replacement
    # every other False stays False: identity on shared values says nothing
    assert defs.HAVE_X is False and defs.other_flag is False and user.unrelated_false is False


def test_revert_restores_every_binding_and_removes_created_names(fake_modules):
    defs, user, _ = fake_modules
    registry = PatchRegistry(rebind_prefixes=("fakepkg",))
    registry.register("fakepkg.defs.Thing", Replacement)
    registry.register("fakepkg.user.HAVE_X", True)
    registry.register("fakepkg.user.NEW_NAME", 1, create=True)
    registry.apply()
    registry.revert()
    assert defs.Thing is Original and user.Thing is Original and user.HAVE_X is False
    assert not hasattr(user, "NEW_NAME")
    assert not registry.applied
    registry.apply()  # and it can be applied again
    assert user.Thing is Replacement


def test_bad_targets_fail_before_anything_changes(fake_modules):
    defs, user, _ = fake_modules
    registry = PatchRegistry(rebind_prefixes=("fakepkg",))
    registry.register("fakepkg.defs.Thing", Replacement)
    registry.register("fakepkg.defs.missing", Replacement)
    with pytest.raises(PatchError, match="fakepkg.defs.missing.*has no attribute 'missing'"):
        registry.apply()
    assert defs.Thing is Original and user.Thing is Original and not registry.applied

    registry = PatchRegistry()
    registry.register("no_such_module_xyz.attr", 1)
    with pytest.raises(PatchError, match="no_such_module_xyz.*does not import"):
        registry.apply()


def test_registration_errors():
    registry = PatchRegistry()
    with pytest.raises(PatchError, match="must be 'module.attribute'"):
        registry.register("noattribute", 1)
    registry.register("a.b", 1)
    with pytest.raises(PatchError, match="already patched"):
        registry.register("a.b", 2)
    registry.register("a.b", 2, force=True)
    assert [p.replacement for p in registry.patches] == [2]


def test_a_second_registry_on_the_same_targets_is_refused_until_the_first_is_reverted(fake_modules):
    defs, user, _ = fake_modules
    first, second = PatchRegistry(rebind_prefixes=("fakepkg",)), PatchRegistry(rebind_prefixes=("fakepkg",))
    first.register("fakepkg.defs.Thing", Replacement)
    second.register("fakepkg.defs.Thing", Replacement)
    first.apply()
    with pytest.raises(PatchError, match=r"'fakepkg.defs.Thing': another patch registry has already patched it"):
        second.apply()
    assert not second.applied and user.Thing is Replacement
    first.revert()
    second.apply()  # once the first is gone, the second applies and reverts normally
    assert user.Thing is Replacement
    second.revert()
    assert user.Thing is Original


def test_patch_errors_name_target_and_megatron_versions(fake_modules):
    registry = PatchRegistry(rebind_prefixes=("fakepkg",))
    registry.register("fakepkg.defs.missing", Replacement)
    with pytest.raises(PatchError, match=r"'fakepkg.defs.missing'.*installed megatron-core \S+, supported 0\.12-0\.19"):
        registry.apply()


def test_building_the_megatron_patches_names_a_missing_target(monkeypatch):
    """A Megatron name the patch table reads while it is built (another megatron-core release) fails as a
    PatchError with the target and the versions, not a bare AttributeError."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("megatron.core.extensions.transformer_engine_spec_provider", reason="0.13 on")
    from megatron.core.extensions import transformer_engine_spec_provider

    from mindspeed_te.patches import build_registry

    monkeypatch.delattr(transformer_engine_spec_provider, "TESpecProvider")
    with pytest.raises(PatchError, match=r"transformer_engine_spec_provider\.TESpecProvider'.*has no attribute.*"
                                         r"installed megatron-core \S+, supported 0\.12-0\.19"):
        build_registry()


def test_building_the_megatron_patches_names_a_blocked_module(monkeypatch):
    pytest.importorskip("megatron.core")
    import megatron.core.optimizer as optimizer

    from mindspeed_te.patches import build_registry

    monkeypatch.setitem(sys.modules, "megatron.core.optimizer.distrib_optimizer", None)
    monkeypatch.delattr(optimizer, "distrib_optimizer")
    with pytest.raises(PatchError, match=r"distrib_optimizer.*does not import.*"
                                         r"installed megatron-core \S+, supported 0\.12-0\.19"):
        build_registry()


def test_building_the_training_patches_names_a_missing_train_step(monkeypatch):
    pytest.importorskip("megatron.training", reason="needs Megatron-LM's training package (MEGATRON_LM_PATH)")
    from megatron.training import training

    from mindspeed_te.patches import build_registry

    monkeypatch.delattr(training, "train_step")
    with pytest.raises(PatchError, match=r"'megatron\.training\.training\.train_step'.*supported 0\.12-0\.19"):
        build_registry()


@pytest.mark.parametrize("release", ["0.11.0", "0.20.0rc0", "1.0.0"])
def test_an_unsupported_megatron_release_is_refused_naming_the_supported_ones(monkeypatch, release):
    pytest.importorskip("megatron.core")
    import mindspeed_te.patches as patches

    monkeypatch.setattr(patches, "installed_megatron_core", lambda: release)
    with pytest.raises(PatchError, match=rf"does not support megatron-core {re.escape(release)}; supported releases: "
                                         r"0\.12\.x, 0\.13\.x, .*0\.19\.x"):
        patches.build_registry()


@pytest.mark.parametrize("release, supported", [("0.12.1", True), ("0.16.1", True), ("0.18.0rc0", True),
                                                ("0.19.0", True), ("0.1.0", False), ("0.11.0", False),
                                                ("0.20.0", False), ("1.12.0", False)])
def test_supported_release_lines(release, supported):
    from mindspeed_te.patches.registry import supported_release

    assert supported_release(release) is supported


def test_numpy_product_is_back_while_the_patches_are_applied():
    """megatron-core up to 0.15 saves distributed checkpoints through numpy.product, which NumPy 2 removed."""
    pytest.importorskip("megatron.core")
    import numpy

    from mindspeed_te.patches import build_registry

    had = hasattr(numpy, "product")
    registry = build_registry()
    registry.apply()
    try:
        assert numpy.product([2, 3, 4]) == 24
    finally:
        registry.revert()
    assert hasattr(numpy, "product") == had


def test_megatron_0_12_checkpoint_writer_gets_torchs_serialization_format():
    """torch 2.7 made the writer's serialization_format required; 0.12's asynchronous writer does not pass it, so
    its binding passes torch's TORCH_SAVE (what 0.13 on pass), and leaves a given format alone."""
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    from mindspeed_te.patches.library_compat import _torch_save_format

    def write_item(*args, serialization_format):
        return args, serialization_format

    assert _torch_save_format(write_item)(1, 2) == ((1, 2), SerializationFormat.TORCH_SAVE)
    assert _torch_save_format(write_item)(1, serialization_format="other") == ((1,), "other")
