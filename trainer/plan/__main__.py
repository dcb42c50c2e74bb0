"""``python -m trainer.plan``: the dry run's command line (:mod:`trainer.plan.cli`)."""

from .cli import main

raise SystemExit(main())
