"""Installed names that cannot be shadowed (setup.py): a wheel of this checkout, installed on its
own, runs every command from a directory that holds unrelated ``tools/`` and ``trainer/`` packages,
also when that directory is first on PYTHONPATH (Megatron-LM and MindSpeed ship a ``tools/``); and
``python -m trainer.train`` still runs from the repository root."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.support import REPO

SHADOW = 'raise ImportError("the shadowing package was imported")\n'


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"  # a copy: the build leaves its build/ and egg-info there, not in the checkout
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(REPO / name, source / name)
    for name in ("ckpt", "trainer", "tools"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(work / "dist"), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = (work / "dist").glob("ckpt_engine-*.whl")
    site = work / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile", "--target",
                    str(site), str(wheel)], check=True, capture_output=True, timeout=300)
    shadow = work / "elsewhere"
    for package in ("tools", "trainer"):
        (shadow / package).mkdir(parents=True)
        (shadow / package / "__init__.py").write_text(SHADOW)
        (shadow / package / "merge.py").write_text(SHADOW)
    return site, shadow


def _run(args, site, shadow):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), str(site)])}
    return subprocess.run([sys.executable, *args], cwd=shadow, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["ckpt-merge", "ckpt-convert", "ckpt-inspect", "ckpt-replay", "ckpt-train"])
def test_every_installed_command_runs_beside_shadowing_packages(installed, command):
    site, shadow = installed
    result = _run([str(site / "bin" / command), "--help"], site, shadow)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "shadowing package" not in result.stderr
    assert ("usage: " + command) in result.stdout or (command == "ckpt-train" and "--config" in result.stdout)


@pytest.mark.slow
def test_the_installed_packages_are_the_wheels_own(installed):
    site, shadow = installed
    probe = ("import ckpt, ckpt_tools.convert, ckpt_trainer.train, ckpt_trainer.hf; from ckpt_tools import convert_model; "
             "print(ckpt.__file__, ckpt_tools.convert.__file__, ckpt_trainer.hf.__file__, ckpt_tools.convert.hf.__name__, "
             "ckpt_tools.convert.titan.__name__, convert_model.config.__name__, convert_model.ModelArgs.__module__)")
    result = _run(["-c", probe], site, shadow)
    assert result.returncode == 0, result.stderr[-2000:]
    *files, hf_module, titan_module, config_module, model_args_module = result.stdout.split()
    assert all(path.startswith(str(site)) for path in files), files
    # the tools' trainer imports (tools/convert.py, tools/convert_model.py) reach the trainer installed beside them
    assert (hf_module, titan_module, config_module) == ("ckpt_trainer.hf", "ckpt_trainer.titan", "ckpt_trainer.config")
    assert model_args_module.startswith("ckpt_trainer.")
    corpus = _run(["-c", "from ckpt_trainer.data import load_documents; print(len(load_documents('shipped')))"],
                  site, shadow)
    assert corpus.returncode == 0 and int(corpus.stdout) > 0, corpus.stderr[-2000:]


def test_python_m_trainer_train_runs_from_the_repository_root():
    result = subprocess.run([sys.executable, "-m", "trainer.train", "--help"], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "--config" in result.stdout, result.stderr[-2000:]
