"""Run a function right after a module has been loaded, before its importer sees it.

The bootstrap acts on the script's libraries (torch for the emulated device and the step
reports, accelerate and diffusers for the resume corrections) without importing any of them
itself: a script that never imports torch must not pay for it, and nothing may run before the
script's own imports choose their options.

Libraries probe for a module before (or instead of) importing it: datasets and transformers
call ``importlib.util.find_spec("torch")`` and import torch much later, and importlib's own
recipe loads a module from such a spec with ``module_from_spec`` and ``exec_module``. The
finder therefore stays on ``sys.meta_path`` until the module has really been executed, and
every spec it hands out carries the wrapped loader. Standard library only: this runs in the
user's own interpreter.
"""

import importlib.abc
import importlib.machinery
import sys

_CALLBACKS = {}  # module name -> [function(module)], in the order they were asked for


class _AfterLoading(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader the path finder gives for a watched module."""

    def find_spec(self, name, path=None, target=None):
        if name not in _CALLBACKS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module):
            original(module)
            for callback in _CALLBACKS.pop(name, ()):
                callback(module)

        # The path finder makes a new loader for every spec: wrapping it touches no one else's.
        loader.exec_module = exec_module
        return spec


_FINDER = _AfterLoading()


def guarded(what):
    """For oomguard's own bookkeeping in the script's process: an error in it is reported in
    the job's log and the script trains on; a week of training is not lost to a report."""

    def decorate(function):
        said = []

        def run(*args, **kwargs):
            try:
                return function(*args, **kwargs)
            except Exception as error:
                if not said:  # once: a failing step report must not fill the log
                    said.append(True)
                    sys.stderr.write("oomguard: {} failed ({}: {}); the script runs on without it\n".format(what, type(error).__name__, error))
                return None

        return run

    return decorate


def when_imported(name, callback):
    """Call ``callback(module)`` once ``name`` has been loaded (at once if it already is)."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    _CALLBACKS.setdefault(name, []).append(callback)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
