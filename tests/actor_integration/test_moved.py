"""0.1's module paths keep working for one release: the same module, one DeprecationWarning."""

import importlib
import json
import subprocess
import sys

import pytest

from actor_integration._moved import MOVED, MOVED_NAMES, new_name

# The suite turns these warnings into errors (pyproject.toml); here they are what is tested.
pytestmark = pytest.mark.filterwarnings("default:.* moved to actor_integration:DeprecationWarning")


# Each old path is imported in a process that has imported nothing of actor_integration yet (this
# one has imported the new modules already). One interpreter imports torch once and forks a child per
# path: the children start with torch loaded (most of the 3 s an import of the SGLang modules takes)
# and none of the project's modules.
_CHECK_EACH_PATH = """
import importlib, json, os, sys, traceback, warnings
import torch  # noqa: F401  (loaded once, before the forks)
assert not [m for m in sys.modules if m.split('.')[0] == 'actor_integration']
results = {}
for old, new_path in json.loads(sys.argv[1]).items():
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        problem = ''
        try:
            warnings.simplefilter('always')
            with warnings.catch_warnings(record=True) as caught:
                module = importlib.import_module(old)
            new = importlib.import_module(new_path)
            assert module is new, (module, new)
            messages = [str(w.message) for w in caught if w.category is DeprecationWarning]
            assert any(m.startswith(old + ' moved to ' + new_path) for m in messages), messages
        except BaseException:
            problem = traceback.format_exc()
        os.write(write, problem.encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    problem = b''.join(chunks).decode()
    results[old] = problem or ('' if status == 0 else f'the child exited with status {status}')
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def old_path_problems():
    """Each old path -> what went wrong importing it in a fresh process ('' when it is the new module and warned)."""
    proc = subprocess.run(
        [sys.executable, "-c", _CHECK_EACH_PATH, json.dumps(MOVED)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


class TestOldPaths:
    @pytest.mark.parametrize("old", sorted(MOVED))
    def test_an_old_path_is_the_new_module_and_says_where_it_went(self, old, old_path_problems):
        """Importing an old path warns once with the new path and gives the new module object itself."""
        assert old_path_problems[old] == "", old_path_problems[old]

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
