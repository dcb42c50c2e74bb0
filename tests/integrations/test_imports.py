"""The integrations stay optional: ``import ckpt`` imports no framework, and a missing framework's
ImportError names the extra that installs it.

The first check needs a fresh interpreter (what ``import ckpt`` pulls in); the others import the
plug-in in this process with the framework hidden: its modules taken out of ``sys.modules`` (a cached
submodule would otherwise be found without its package) and the package itself marked missing, all
put back afterwards."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys

import pytest

from tests.support import REPO


def test_import_ckpt_imports_no_framework():
    code = ("import sys, ckpt, ckpt.integrations\n"
            "print(sorted(m for m in ('lightning', 'transformers', 'accelerate', 'deepspeed', 'torchtitan')"
            " if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("module, framework, extra", [
    ("lightning", "lightning", "lightning"), ("hf", "transformers", "hf"), ("deepspeed", "deepspeed", "deepspeed"),
    ("torchtitan", "torchtitan", "torchtitan")])
def test_a_missing_framework_names_its_extra(module, framework, extra, monkeypatch):
    for name in [n for n in sys.modules if n == framework or n.startswith(f"{framework}.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, framework, None)  # `import framework` raises ImportError
    monkeypatch.delitem(sys.modules, f"ckpt.integrations.{module}", raising=False)
    with pytest.raises(ImportError, match=re.escape(f"pip install 'ckpt-engine[{extra}]'")):
        importlib.import_module(f"ckpt.integrations.{module}")
