"""Helpers shared by the tests (and, for the servers and launch helpers, by benchmarks/ and scripts/).

No test file imports another test file: what two of them share lives here, one concept a module.

* ``launch``: free ports, the loopback interface, gloo ranks forked from a fork server (``run_ranks``), torchrun agents'
  environment, process trees.
* ``models``: a tiny model with awkward shapes, its parallel layouts, bitwise comparison, flat tensors.
* ``checkpoints``: small single-process checkpoints of plain tensors and the checks on a refused load;
  a byte flipped in a committed checkpoint, unpickling forbidden;
  a state of mixed dtypes for the exports.
* ``chains``: delta chains saved through the manager and loaded back.
* ``parallel``: TinyNet checkpoints saved from parallel layouts (resharding, merging).
* ``trainer_runs``: the trainer's command line for the debug model and one in-process run.
* ``lightning_runs``, ``hf_runs``, ``deepspeed_runs``: tiny models and runs of the real frameworks
  for tests/integrations (importing one imports its framework).
* ``dcp_sources``: plain DCP checkpoints the import tests convert or damage.
* ``imports``: the import graph of our packages read from the source (circles, internal names reached).
* ``faults``: fault injection behind the storage seam (``ckpt.storage.wrapped``), real tmpfs mounts.
* ``s3server`` (moto on loopback), ``s3proxy`` (a proxy that drops, slows, errors or truncates) and
  ``http_framing`` (the proxy's HTTP/1.1 message framing).

``REPO`` is the checkout's root (tests move between folders; this does not).
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
