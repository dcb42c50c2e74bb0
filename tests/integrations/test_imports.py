"""The integrations stay optional: ``import ckpt`` imports no framework, a missing framework's
ImportError names the extra that installs it, and the torchtitan plug-in imports without triton.

What an import pulls in needs a fresh interpreter: one, shared by the module (:func:`fresh_imports`),
imports ``ckpt`` and lists the frameworks loaded, then imports the torchtitan plug-in with triton
hidden. The missing frameworks are checked in this process: the framework's modules taken out of
``sys.modules`` (a cached submodule would otherwise be found without its package) and the package
itself marked missing, all put back afterwards."""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import subprocess
import sys

import pytest

from tests.support import REPO

_FRESH = """
import json, sys
import ckpt, ckpt.integrations
names = ('lightning', 'transformers', 'accelerate', 'deepspeed', 'torchtitan')
frameworks = sorted(m for m in names if m in sys.modules)
sys.modules['triton'] = None
try:
    import ckpt.integrations.torchtitan
    titan = {'imported': True, 'torchtitan.trainer': 'torchtitan.trainer' in sys.modules}
except ImportError as exc:
    titan = {'imported': False, 'error': str(exc)}
print(json.dumps({'frameworks': frameworks, 'titan': titan}))
"""


@pytest.fixture(scope="module")
def fresh_imports() -> dict:
    done = subprocess.run([sys.executable, "-c", _FRESH], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_import_ckpt_imports_no_framework(fresh_imports):
    assert fresh_imports["frameworks"] == []


def test_the_torchtitan_plugin_imports_without_triton(fresh_imports):
    """torchtitan's models import triton; the plug-in reaches none of them (no torchtitan.trainer)."""
    if importlib.util.find_spec("torchtitan") is None:
        pytest.skip("torchtitan (the torchtitan extra) not installed")
    assert fresh_imports["titan"] == {"imported": True, "torchtitan.trainer": False}


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
