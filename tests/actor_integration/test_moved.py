"""0.1's module paths keep working for one release: the same module, one DeprecationWarning."""

import importlib
import subprocess
import sys

import pytest

from actor_integration._moved import MOVED, MOVED_NAMES, new_name

# The suite turns these warnings into errors (pyproject.toml); here they are what is tested.
pytestmark = pytest.mark.filterwarnings("default:.* moved to actor_integration:DeprecationWarning")


class TestOldPaths:
    @pytest.mark.parametrize("old", sorted(MOVED))
    def test_an_old_path_is_the_new_module_and_says_where_it_went(self, old):
        """Importing an old path warns once with the new path and gives the new module object itself."""
        code = (
            "import importlib, warnings\n"
            "warnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            f"    old = importlib.import_module({old!r})\n"
            f"new = importlib.import_module({MOVED[old]!r})\n"
            "assert old is new, (old, new)\n"
            "messages = [str(w.message) for w in caught if w.category is DeprecationWarning]\n"
            f"assert any(m.startswith({old!r} + ' moved to ' + {MOVED[old]!r}) for m in messages), messages\n"
        )
        # A fresh interpreter per path: this one has imported the new modules already.
        subprocess.run([sys.executable, "-c", code], check=True)

    def test_a_submodule_under_an_old_package_path_resolves(self):
        """`actor_integration.demo.step` and `actor_integration.process_groups._way` name the moved modules."""
        with pytest.warns(DeprecationWarning, match="moved to actor_integration.tools.demo.step"):
            old = importlib.import_module("actor_integration.demo.step")
        assert old is importlib.import_module("actor_integration.tools.demo.step")
        assert new_name("actor_integration.process_groups._way") == (
            "actor_integration.backends.process_groups._way"
        )

    def test_a_class_from_an_old_path_is_the_same_class(self):
        """isinstance checks and Ray's pickles by qualified name see one class under both paths."""
        with pytest.warns(DeprecationWarning):
            from actor_integration.slime import SlimeLifecycleMixin as Old
        from actor_integration.frameworks.slime import SlimeLifecycleMixin

        assert Old is SlimeLifecycleMixin
        assert SlimeLifecycleMixin.__module__ == "actor_integration.frameworks.slime.trainer"

    def test_an_old_submodule_of_a_package_that_still_exists_is_the_moved_module(self):
        """`actor_integration.rollout` stays a package; its old SGLang submodules name the moved ones,
        and a class pickled by its new name is the class the old path gives."""
        code = (
            "import importlib, pickle, warnings\n"
            "warnings.simplefilter('error', DeprecationWarning)\n"
            "import actor_integration.rollout as rollout\n"
            "from actor_integration.engines.sglang.http import SGLangHTTPEngine\n"
            "try:\n"
            "    importlib.import_module('actor_integration.rollout.sglang_http')\n"
            "except DeprecationWarning as w:\n"
            "    assert 'moved to actor_integration.engines.sglang.http' in str(w), w\n"
            "else:\n"
            "    raise AssertionError('no DeprecationWarning')\n"
            "warnings.simplefilter('ignore', DeprecationWarning)\n"
            "from actor_integration.rollout.sglang_http import SGLangHTTPEngine as Old\n"
            "from actor_integration.frameworks.sglang_actor import SGLangActorLifecycle\n"
            "from actor_integration.frameworks import slime_rollout\n"
            "assert Old is SGLangHTTPEngine\n"
            "assert pickle.loads(pickle.dumps(Old)) is SGLangHTTPEngine\n"
            "assert SGLangActorLifecycle.__module__ == 'actor_integration.engines.sglang.actor'\n"
            "assert slime_rollout.__name__ == 'actor_integration.frameworks.slime.rollout'\n"
            "assert rollout.SGLangEngine.__module__ == 'actor_integration.engines.sglang.engine'\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True)

    def test_names_that_never_moved_are_not_aliased(self):
        """An unknown path is still a plain ModuleNotFoundError, not an alias."""
        assert new_name("actor_integration.weight_sync") is None
        assert new_name("actor_integration.demonstration") is None
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module("actor_integration.no_such_module")


class TestMovedNames:
    """A name that left a module which stays answers there for one release, with one warning."""

    @pytest.mark.parametrize("old", sorted(MOVED_NAMES))
    def test_an_old_name_is_the_new_object_and_says_where_it_went(self, old):
        module, name = old.rsplit(".", 1)
        where, attr = MOVED_NAMES[old].rsplit(".", 1)
        with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED_NAMES[old]}"):
            value = getattr(importlib.import_module(module), name)
        assert value is getattr(importlib.import_module(where), attr)

    def test_the_codec_under_its_0_1_module_path_is_the_wire_codec(self):
        """`from actor_integration.rollout.sglang_receiver import encode_payload`, as 0.1 had it."""
        from actor_integration.weight_sync.wire import encode_payload

        with pytest.warns(DeprecationWarning):
            from actor_integration.rollout.sglang_receiver import encode_payload as old
        assert old is encode_payload

    def test_a_name_that_never_moved_is_still_an_attribute_error(self):
        from actor_integration.engines.sglang import receiver

        with pytest.raises(AttributeError, match="no attribute 'encode_weights'"):
            receiver.encode_weights  # noqa: B018
