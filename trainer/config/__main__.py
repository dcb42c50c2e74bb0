"""``python -m trainer.config``: print docs/CONFIG.md, the key reference (:mod:`trainer.config.reference`).

    python -m trainer.config > docs/CONFIG.md
"""

import sys

from .reference import markdown

if any(arg in ("-h", "--help") for arg in sys.argv[1:]):
    print(__doc__.strip())
    raise SystemExit(0)
if sys.argv[1:]:
    print(f"error: python -m trainer.config takes no arguments (got {' '.join(sys.argv[1:])}); "
          "it prints docs/CONFIG.md", file=sys.stderr)
    raise SystemExit(2)
sys.stdout.write(markdown())
