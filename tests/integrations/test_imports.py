"""The integrations stay optional: ``import ckpt`` imports no framework, and a missing framework's
ImportError names the extra that installs it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import REPO


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_import_ckpt_imports_no_framework():
    done = _run("import sys, ckpt, ckpt.integrations\n"
                "print(sorted(m for m in ('lightning', 'transformers', 'accelerate', 'deepspeed') if m in sys.modules))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("module, framework, extra", [
    ("lightning", "lightning", "lightning"), ("hf", "transformers", "hf"), ("deepspeed", "deepspeed", "deepspeed")])
def test_a_missing_framework_names_its_extra(module, framework, extra):
    done = _run(f"import sys; sys.modules[{framework!r}] = None\n"
                f"import ckpt.integrations.{module}")
    assert done.returncode != 0
    assert f"pip install 'ckpt-engine[{extra}]'" in done.stderr, done.stderr
