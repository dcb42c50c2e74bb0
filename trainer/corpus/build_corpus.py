"""Build ``stdlib_docstrings.txt``: English prose from the docstrings of Python standard library modules.

Run from the repository root (offline; it only imports standard library modules)::

    python trainer/corpus/build_corpus.py

The output is committed, so training never depends on the Python version at run time; rebuilding on
another Python version gives a slightly different file. Docstrings of the CPython standard library are
distributed under the PSF License Agreement (see README.md in this folder).

Format: one document per docstring, the documents separated by one blank line; inside a document the
paragraphs are joined by single newlines (so ``trainer.data.load_documents`` splits it back into the
same documents). The collection is deterministic: a fixed module list, members in sorted order,
exact duplicates dropped, mostly-code docstrings filtered out.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path

MODULES = """
abc argparse ast asyncio.base_events asyncio.events asyncio.futures asyncio.locks asyncio.queues
asyncio.streams asyncio.tasks base64 bdb bisect bz2 calendar cmd code codecs collections
collections.abc concurrent.futures configparser contextlib copy copyreg csv dataclasses datetime
decimal difflib dis doctest email.message email.parser email.utils enum filecmp fileinput
fnmatch fractions ftplib functools getopt gettext glob gzip hashlib heapq hmac html.parser
http.client http.cookiejar http.server imaplib importlib importlib.abc importlib.resources
inspect io ipaddress json json.decoder json.encoder keyword linecache locale logging
logging.handlers lzma mailbox mimetypes multiprocessing.connection multiprocessing.managers
multiprocessing.pool multiprocessing.process multiprocessing.queues netrc numbers operator
optparse os pathlib pdb pickle pickletools pkgutil platform plistlib poplib pprint profile
pstats py_compile pydoc queue quopri random re reprlib rlcompleter runpy sched secrets selectors
shelve shlex shutil signal smtplib socket socketserver statistics string struct subprocess
sysconfig tabnanny tarfile tempfile textwrap threading timeit tokenize trace traceback tracemalloc
types typing unittest.case unittest.loader unittest.main unittest.mock unittest.result
unittest.runner unittest.suite urllib.parse urllib.request urllib.robotparser uuid warnings wave
weakref xml.dom.minidom xml.etree.ElementTree xml.sax.handler xml.sax.saxutils zipapp zipfile
zipimport
""".split()

MIN_WORDS = 25


def docstrings(module) -> list[str]:
    """The module's docstring, then those of its own classes, functions and methods, in name order."""
    found = [inspect.getdoc(module)]
    for name, obj in sorted(vars(module).items()):
        if getattr(obj, "__module__", None) != module.__name__ or name.startswith("_"):
            continue
        if inspect.isclass(obj):
            found.append(inspect.getdoc(obj))
            for _, member in sorted(vars(obj).items()):
                if inspect.isfunction(member) or isinstance(member, (property, classmethod, staticmethod)):
                    found.append(inspect.getdoc(member) if not isinstance(member, (classmethod, staticmethod))
                                 else inspect.getdoc(member.__func__))
        elif inspect.isfunction(obj):
            found.append(inspect.getdoc(obj))
    return [doc for doc in found if doc]


def wordy(text: str, threshold: float = 0.7) -> bool:
    """Whether most whitespace-separated words are plain words (prose rather than code)."""
    words = text.split()
    return bool(words) and sum(w.strip(".,;:()'\"!?-").isalpha() for w in words) / len(words) >= threshold


def prose(doc: str) -> str | None:
    """The docstring as one document of prose paragraphs, or None when too little prose is left."""
    lines = [line.rstrip() for line in doc.splitlines()]
    lines = [line for line in lines if not line.lstrip().startswith((">>>", "..."))]
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", "\n".join(lines))]
    paragraphs = [p for p in paragraphs if wordy(p)]
    text = "\n".join(paragraphs)
    return text if len(text.split()) >= MIN_WORDS else None


def build() -> list[str]:
    seen: set[str] = set()
    out = []
    for name in MODULES:
        module = importlib.import_module(name)
        for doc in docstrings(module):
            text = prose(doc)
            if text and text not in seen:
                seen.add(text)
                out.append(text)
    return out


def main() -> None:
    docs = build()
    path = Path(__file__).with_name("stdlib_docstrings.txt")
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    print(f"{path}: {len(docs)} documents, {path.stat().st_size} bytes (Python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
