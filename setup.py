"""Installed names that cannot be shadowed.

The repository's folders are ``ckpt/``, ``trainer/`` and ``tools/``; a checkout runs them under
those names (``python -m trainer.train`` from its root). Installed, ``trainer`` and ``tools`` would
be top-level names that any other ``trainer/`` or ``tools/`` earlier on ``sys.path`` hides (a
user's repository, Megatron-LM or MindSpeed on PYTHONPATH), and every ``ckpt-*`` command would fail
with "No module named 'tools.merge'". So a wheel installs them as ``ckpt_trainer`` and
``ckpt_tools``: their code imports its own package relatively, and a tool that needs the trainer
imports it by the name of its own installation, ``ckpt_trainer`` when ``__package__`` is
``ckpt_tools``, else ``trainer``: two plain import statements, so the dependency is in the import
graph the layering tests read (tests/support/imports.py), and the same files run from a checkout,
an editable install (which runs the checkout's files: no build step could rename their imports)
and a wheel. Everything else about the package is in pyproject.toml.
"""

from setuptools import find_packages, setup

INSTALLED_AS = {"trainer": "ckpt_trainer", "tools": "ckpt_tools"}


def installed_name(package: str) -> str:
    top, dot, rest = package.partition(".")
    return INSTALLED_AS.get(top, top) + dot + rest


setup(
    packages=[installed_name(p) for p in find_packages(include=["ckpt", "ckpt.*", "trainer", "trainer.*",
                                                                "tools", "tools.*"])],
    package_dir={installed: folder for folder, installed in INSTALLED_AS.items()},
    package_data={"ckpt_trainer": ["corpus/*.txt", "corpus/*.md"]},
)
